import inspect
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision, Precision
from lightning.pytorch.trainer.connectors import accelerator_connector
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from typing_extensions import override

import lightning_boost
from lightning_boost import BoostReport, preset, presets
from lightning_boost._lightning import trainer_precision_flag
from lightning_boost.hardware import EXAMPLES, HardwareInfo
from lightning_boost.presets import (
    PresetDDPStrategy,
    PresetFSDPStrategy,
    PresetSingleDeviceStrategy,
    plan_preset,
)
from lightning_boost.presets.plans import bucket_cap_mb, ddp_accepts, model_parameter_count
from lightning_boost.report import Severity
from lightning_boost.testing import BoringDataModule, BoringModel, tiny_trainer

EXAMPLES_DIR = Path(__file__).parents[1] / "examples"


def build(name: str, hw: HardwareInfo, **overrides: object) -> L.pytorch.strategies.Strategy:
    # Simulated GPUs: building fp16 AMP for CUDA on this CPU machine makes GradScaler warn that
    # CUDA is absent; the strategy object is what these decision tests look at.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*", category=UserWarning)
        return preset(name, hardware=hw, **overrides)


# (hardware, preset) -> strategy type, precision, comm hook, tf32, cudnn.benchmark
DECISIONS = [
    ("cpu", "auto", PresetSingleDeviceStrategy, "32-true", None, False, False),
    ("cpu", "fast-ddp", PresetDDPStrategy, "32-true", None, False, False),
    ("cpu", "fast-ddp-multinode", PresetDDPStrategy, "32-true", None, False, False),
    ("cpu-bf16", "auto", PresetSingleDeviceStrategy, "bf16-mixed", None, False, False),
    ("cpu-bf16", "fast-ddp", PresetDDPStrategy, "bf16-mixed", None, False, False),
    ("t4", "auto", PresetSingleDeviceStrategy, "16-mixed", None, False, True),
    ("t4", "fast-ddp", PresetDDPStrategy, "16-mixed", None, False, True),
    ("v100", "fast-ddp-multinode", PresetDDPStrategy, "16-mixed", "fp16", False, True),
    ("v100", "fsdp", PresetFSDPStrategy, "16-mixed", None, False, True),
    ("a100x8", "auto", PresetDDPStrategy, "bf16-mixed", None, True, True),
    ("a100x8", "fast-ddp", PresetDDPStrategy, "bf16-mixed", None, True, True),
    ("a100x8", "fsdp", PresetFSDPStrategy, "bf16-mixed", None, True, True),
    ("h100", "auto", PresetSingleDeviceStrategy, "bf16-mixed", None, True, True),
    ("h100", "fast-ddp", PresetDDPStrategy, "bf16-mixed", None, True, True),
    ("h100x8", "auto", PresetDDPStrategy, "bf16-mixed", None, True, True),
    ("h100x8", "fast-ddp-multinode", PresetDDPStrategy, "bf16-mixed", "bf16", True, True),
    ("h100x8", "fsdp", PresetFSDPStrategy, "bf16-mixed", None, True, True),
    ("h100x8-2nodes", "auto", PresetDDPStrategy, "bf16-mixed", "bf16", True, True),
    ("h100x8-2nodes", "fast-ddp-multinode", PresetDDPStrategy, "bf16-mixed", "bf16", True, True),
    ("h100x8-2nodes", "fsdp", PresetFSDPStrategy, "bf16-mixed", None, True, True),
]


@pytest.mark.parametrize(("hw", "name", "kind", "precision", "hook", "tf32", "bench"), DECISIONS)
def test_preset_decisions(
    hw: str,
    name: str,
    kind: type,
    precision: str,
    hook: str | None,
    tf32: bool,
    bench: bool,
) -> None:
    strategy = build(name, EXAMPLES[hw])
    assert type(strategy) is kind
    plan = strategy.plan
    assert (plan.precision, plan.tf32, plan.cudnn_benchmark) == (precision, tf32, bench)
    assert plan.measure_autocast == (hw == "cpu-bf16")  # a CPU's bf16 is measured on the run's steps
    plugin = strategy.precision_plugin
    if precision == "32-true":
        assert type(plugin) is Precision
    else:
        assert isinstance(plugin, FSDPPrecision if kind is PresetFSDPStrategy else MixedPrecision)
        measured = plan.measure_autocast  # "32-true" until its trial, before the first step, says bf16
        assert plugin.precision == ("32-true" if measured else precision)
        assert (plugin.scaler is not None) == (precision == "16-mixed")
    if kind is PresetDDPStrategy:
        assert strategy._ddp_kwargs == {
            "find_unused_parameters": False,
            "gradient_as_bucket_view": True,
            "bucket_cap_mb": 25,
            "static_graph": False,
        } | ({"batched_grad_copy": True} if ddp_accepts("batched_grad_copy") else {})
        assert strategy.process_group_backend is None  # resolved from the trainer's device at setup
        assert strategy._start_method == "popen"
        expected_hook = {
            None: None,
            "bf16": default_hooks.bf16_compress_hook,
            "fp16": default_hooks.fp16_compress_hook,
        }[hook]
        assert strategy._ddp_comm_hook is expected_hook
    if kind is PresetFSDPStrategy:
        assert strategy.process_group_backend is None
        sharding = "HYBRID_SHARD" if EXAMPLES[hw].is_multi_node else "FULL_SHARD"
        assert strategy.sharding_strategy.name == sharding
        assert strategy.kwargs["limit_all_gathers"] and strategy.kwargs["use_orig_params"]
        assert strategy.kwargs["auto_wrap_policy"].keywords == {"min_num_params": 10_000_000}
    assert {f.area for f in strategy.findings} == {"precision and strategy"}
    assert any(f.data.get("precision") == precision for f in strategy.findings)


@pytest.mark.parametrize(
    ("hw", "changes", "params", "resolved"),
    [
        ("cpu", {}, None, "single"),
        ("cpu", {"local_world_size": 2}, None, "fast-ddp"),  # launched by torchrun on a CPU box
        ("h100", {}, 10**10, "single"),  # one device: nothing to shard over
        ("a100x8", {}, 10**9, "fast-ddp"),  # 16 GB of training state fits an 80 GB device
        ("a100x8", {}, 3 * 10**9, "fsdp"),  # 48 GB does not fit with room for activations
        ("h100x8-2nodes", {}, None, "fast-ddp-multinode"),
        ("h100x8-2nodes", {}, 10**10, "fsdp"),
    ],
)
def test_auto_resolution(hw: str, changes: dict[str, int], params: int | None, resolved: str) -> None:
    plan = plan_preset("auto", EXAMPLES[hw].replace(**changes), params)
    assert plan.resolved == resolved
    assert "auto resolved to" in plan.findings[1].detail


@pytest.mark.parametrize(
    ("params", "expected"), [(None, 25), (10**6, 25), (10**8, 38), (2 * 10**8, 76), (10**9, 100)]
)
def test_bucket_size_grows_with_the_model(params: int | None, expected: int) -> None:
    assert bucket_cap_mb(params) == expected
    if params is not None:
        assert plan_preset("fast-ddp", EXAMPLES["a100x8"], params).options["bucket_cap_mb"] == expected


def test_batched_grad_copy_only_where_torch_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from lightning_boost.presets import plans

    arguments = inspect.signature(DistributedDataParallel.__init__).parameters
    assert plans.ddp_accepts("batched_grad_copy") == ("batched_grad_copy" in arguments)
    monkeypatch.setattr(plans, "ddp_accepts", lambda argument: False)  # an older torch
    options = plan_preset("fast-ddp", EXAMPLES["cpu"]).options
    assert "batched_grad_copy" not in options and options["gradient_as_bucket_view"] is True


def test_model_size_from_module_or_count() -> None:
    assert model_parameter_count(BoringModel()) == 32 * 2 + 2
    assert model_parameter_count(123) == 123 and model_parameter_count(None) is None
    with pytest.raises(
        TypeError, match=r"`model` expected an nn.Module or a parameter count \(int\), got str"
    ):
        model_parameter_count("resnet")
    with pytest.raises(ValueError, match="parameter count >= 0"):
        model_parameter_count(-1)


@pytest.mark.parametrize(
    ("name", "hw", "overrides", "match"),
    [
        (
            "fast-dp",
            "cpu",
            {},
            r"`name` expected one of 'auto', 'fast-ddp', .* got 'fast-dp'. Did you mean 'fast-ddp'",
        ),
        (
            "fast-ddp",
            "cpu",
            {"bucket_cap": 50},
            r"unknown argument `bucket_cap`.* Did you mean 'bucket_cap_mb'",
        ),
        ("fsdp", "a100x8", {"static_graph": True}, r"got 'static_graph'"),
        ("auto", "cpu", {"bucket_cap_mb": 50}, r"got 'bucket_cap_mb'"),  # auto is one device here
        (
            "fast-ddp",
            "a100x8",
            {"precision": "bf16-mix"},
            r"`precision` expected one of .*got 'bf16-mix'. Did you mean 'bf16-mixed'",
        ),
        (
            "fast-ddp",
            "cpu",
            {"precision": "16-mixed"},
            r"`precision` '16-mixed' needs CUDA .* Use 'bf16-mixed' or '32-true'",
        ),
        ("fsdp", "cpu", {}, r"'fsdp' needs CUDA devices.*preset\('fast-ddp'\)"),
    ],
)
def test_bad_input_raises(name: str, hw: str, overrides: dict[str, object], match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        preset(name, hardware=EXAMPLES[hw], **overrides)


def test_overrides_win_and_are_reported() -> None:
    strategy = build("fast-ddp", EXAMPLES["a100x8"], static_graph=True, precision="16-mixed", tf32=False)
    assert strategy._ddp_kwargs["static_graph"] is True
    assert strategy.plan.precision == "16-mixed" and strategy.plan.tf32 is False
    assert strategy.findings[0].detail == "set by hand"
    slow = build("fast-ddp", EXAMPLES["t4"], precision="bf16-mixed").findings[0]
    assert slow.severity is Severity.WARN and slow.fix == "precision='16-mixed'"


@pytest.mark.parametrize(
    ("alias", "precision"), [("bf16", "bf16-mixed"), (16, "16-mixed"), ("32", "32-true")]
)
def test_lightning_precision_aliases(alias: object, precision: str) -> None:
    assert plan_preset("fast-ddp", EXAMPLES["a100x8"], precision=alias).precision == precision


def test_presets_lists_names_with_descriptions() -> None:
    listed = presets()
    assert list(listed) == ["auto", "fast-ddp", "fast-ddp-multinode", "fsdp"]
    assert all(isinstance(text, str) and text for text in listed.values())
    listed.clear()
    assert presets()  # a copy


def test_presets_is_the_function_even_after_its_subpackage_is_imported() -> None:
    # The package loads its names lazily; importing the subpackage `lightning_boost.presets`
    # first must not leave the module where `from lightning_boost import presets` is imported.
    code = (
        "import lightning_boost.presets.plans;"
        "from lightning_boost import presets;"
        "assert callable(presets) and 'auto' in presets(), presets"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr


def test_strategy_pickles_for_spawned_processes() -> None:
    strategy = pickle.loads(pickle.dumps(build("fast-ddp-multinode", EXAMPLES["h100x8-2nodes"])))
    assert strategy._ddp_comm_hook is default_hooks.bf16_compress_hook


@pytest.mark.parametrize("name", ["fast-ddp", "fast-ddp-multinode"])
def test_registry_name_says_to_call_preset(name: str) -> None:
    with pytest.raises(
        ValueError, match=rf"Trainer\(strategy='{name}'\) cannot carry .*strategy=preset\('{name}'\)"
    ):
        L.Trainer(strategy=name)


def test_lightning_own_names_are_left_alone() -> None:
    from lightning.pytorch.strategies import FSDPStrategy, StrategyRegistry

    assert StrategyRegistry["fsdp"]["strategy"] is FSDPStrategy  # "fsdp" stays Lightning's own


def test_trainer_precision_flag_reads_the_users_choice(tmp_path: Path) -> None:
    assert trainer_precision_flag(tiny_trainer(tmp_path)) == "32-true"
    assert trainer_precision_flag(tiny_trainer(tmp_path, precision="bf16-mixed")) == "bf16-mixed"
    trainer = tiny_trainer(
        tmp_path, strategy=preset("auto", hardware=EXAMPLES["cpu"]), precision="bf16-mixed"
    )
    assert trainer.precision == "32-true"  # Lightning takes the strategy's plugin ...
    assert trainer_precision_flag(trainer) == "bf16-mixed"  # ... and the user's flag is still here


def test_conflicting_trainer_precision_is_an_error(tmp_path: Path) -> None:
    model = BoringModel()
    before = model.layer.weight.detach().clone()
    trainer = tiny_trainer(
        tmp_path, strategy=preset("auto", hardware=EXAMPLES["cpu"]), precision="bf16-mixed"
    )
    with pytest.raises(
        ValueError,
        match=r"precision='bf16-mixed'\) conflicts with preset\('auto'\).*"
        r"preset\('auto', precision='bf16-mixed'\)",
    ):
        trainer.fit(model, datamodule=BoringDataModule())
    assert torch.equal(model.layer.weight, before)  # nothing trained


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_preset_precision_reaches_the_live_trainer(tmp_path: Path, precision: str) -> None:
    on_cpu = HardwareInfo.detect().on_cpu()  # `tiny_trainer` pins the CPU, on a GPU machine too
    strategy = preset("auto", hardware=on_cpu, precision=precision)
    trainer = tiny_trainer(tmp_path, strategy=strategy, precision=precision)
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert trainer.precision == precision
    assert trainer.global_step == 4


class _RecordFlags(L.Callback):
    seen: tuple[str, bool] | None = None

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int
    ) -> None:
        self.seen = (torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark)


@pytest.mark.parametrize(("deterministic", "benchmark_seen"), [(False, True), (True, False)])
def test_speed_flags_set_for_the_run_and_put_back(
    tmp_path: Path, deterministic: bool, benchmark_seen: bool
) -> None:
    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark)
    assert before == ("highest", False)  # not changed by importing lightning_boost
    record = _RecordFlags()
    strategy = preset("auto", hardware=EXAMPLES["cpu"], tf32=True, cudnn_benchmark=True)
    trainer = tiny_trainer(tmp_path, strategy=strategy, callbacks=[record], deterministic=deterministic)
    try:
        trainer.fit(BoringModel(), datamodule=BoringDataModule())
    finally:
        torch.use_deterministic_algorithms(False)
    assert record.seen == ("high", benchmark_seen)
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark) == before


EXIT_SCRIPT = """
import atexit, os, torch.distributed as dist
from lightning_boost._lightning import destroy_process_group_at_exit
atexit.register(lambda: print("initialized at exit:", dist.is_initialized()))  # runs last (LIFO)
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=0, world_size=1)
destroy_process_group_at_exit()
destroy_process_group_at_exit()  # a second strategy in the same process registers nothing more
"""


@pytest.mark.ddp
def test_gloo_group_destroyed_before_interpreter_shutdown(tmp_path: Path) -> None:
    """A gloo group left to interpreter shutdown can abort a finished run (SIGABRT after fit)."""
    env = {**os.environ, "STORE": str(tmp_path / "store")}
    result = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "initialized at exit: False"


@pytest.mark.ddp
def test_fast_ddp_two_cpu_processes(tmp_path: Path) -> None:
    """The real thing: the example script, launched by Lightning's default popen start method. It
    imports the package this test does, however the suite found it (a relative PYTHONPATH entry
    does not reach it from the temporary directory the script runs in)."""
    here = str(Path(lightning_boost.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES_DIR / "ddp_cpu.py"),
            "--devices",
            "2",
            "--steps",
            "6",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert ranks[0]["weights"]["layer.weight"] != BoringModel().state_dict()["layer.weight"].tolist()
    promised = plan_preset("fast-ddp", HardwareInfo.detect())
    for live in ranks:
        assert live["strategy"] == "PresetDDPStrategy" and live["world_size"] == 2
        assert live["precision"] in (promised.precision, "32-true")  # a CPU's measured bf16 may keep fp32
        assert live["backend"] == "gloo" and promised.options["process_group_backend"] is None
        assert live["bucket_bytes_cap"] == promised.options["bucket_cap_mb"] * 1024 * 1024
        flags = ("find_unused_parameters", "gradient_as_bucket_view", "static_graph", "batched_grad_copy")
        for flag in flags:
            assert live[flag] == promised.options.get(flag), flag  # batched_grad_copy: torch >= 2.14
    assert "fast-ddp: DDPStrategy(" in result.stdout


class RankWeights(BoringModel):
    """Writes each rank's process-group backend and trained weights."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out

    @override
    def on_train_end(self) -> None:
        record = {"backend": torch.distributed.get_backend(), "weight": self.layer.weight.tolist()}
        Path(self.out, f"rank{self.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.ddp
def test_in_a_notebook_ddp_starts_its_processes_by_fork(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Simulated: an interactive session (a notebook, a REPL) training 2 CPU processes. A
    script's `popen` cannot start from one: Lightning refused the preset ("not compatible with an
    interactive environment ... `ddp_notebook`"). CPU processes fork, as `ddp_notebook` does, and
    the finding says why; `start_method=` by hand still wins."""
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)  # what Lightning's test reads, at its import
    monkeypatch.setattr(accelerator_connector, "_IS_INTERACTIVE", True)
    assert (
        preset("fast-ddp", hardware=EXAMPLES["cpu"], start_method="spawn").plan.options["start_method"]
        == "spawn"
    )
    # on CUDA the device query has initialized CUDA in the notebook's process: no fork (docs)
    assert plan_preset("fast-ddp", EXAMPLES["a100x8"]).options["start_method"] == "popen"
    strategy = preset("fast-ddp", hardware=EXAMPLES["cpu"], precision="32-true")
    assert strategy.plan.options["start_method"] == "fork"
    assert any("fork" in f.detail and "interactive" in f.detail for f in strategy.findings)
    trainer = tiny_trainer(tmp_path, devices=2, strategy=strategy, logger=False, enable_checkpointing=False)
    trainer.fit(RankWeights(str(tmp_path)), datamodule=BoringDataModule(length=64))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["weight"] == ranks[1]["weight"]


@pytest.mark.ddp
def test_a_preset_planned_on_a_gpu_machine_follows_the_trainers_accelerator(tmp_path: Path) -> None:
    # Simulated: the preset is planned for an H100 machine (as `HardwareInfo.detect()` sees one),
    # the trainer asks for 2 CPU processes: the backend must be gloo, not the NCCL that died there.
    strategy = preset("fast-ddp", hardware=EXAMPLES["h100"], precision="32-true", start_method="spawn")
    assert strategy.process_group_backend is None
    trainer = tiny_trainer(tmp_path, devices=2, strategy=strategy, logger=False, enable_checkpointing=False)
    trainer.fit(RankWeights(str(tmp_path)), datamodule=BoringDataModule(length=64))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["backend"] for r in ranks] == ["gloo", "gloo"]
    assert ranks[0]["weight"] == ranks[1]["weight"]


class FineTunedRanks(L.LightningModule):
    """A backbone `BackboneFinetuning` unfreezes at epoch 1, under DDP; each rank writes its
    weights and whether the preset's findings say it averaged the unfrozen ones."""

    def __init__(self, out: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.out = out
        self.backbone = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 2)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.head(self.backbone(inputs)), targets)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    @override
    def on_train_end(self) -> None:
        findings = [*getattr(self.trainer.strategy, "findings", [])]
        findings += [f for c in self.trainer.callbacks for f in getattr(c, "findings", [])]  # type: ignore[attr-defined]
        record = {
            "weights": [p.detach().flatten().tolist() for p in self.parameters()],
            "averaged": [f.data["late_tensors"] for f in findings if "late_tensors" in f.data],
            "apart": [f.data["unaveraged_tensors"] for f in findings if "unaveraged_tensors" in f.data],
        }
        Path(self.out, f"rank{self.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.ddp
@pytest.mark.parametrize("boosted", [True, False], ids=["preset", "lightnings-ddp"])
def test_a_backbone_unfrozen_under_ddp_trains_the_same_on_every_rank(tmp_path: Path, boosted: bool) -> None:
    """DDP averages only the parameters that trained when it wrapped the model: a backbone
    `BackboneFinetuning` unfroze later trained on each rank's own batches (Lightning issue #20340),
    and the replicas drifted apart without an error, as Lightning's own DDP still lets them (the
    control). The preset averages their gradients, and says so; under Lightning's DDP the report
    names the drift."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    strategy = preset("fast-ddp", hardware=EXAMPLES["cpu"], precision="32-true", start_method="spawn")
    trainer = tiny_trainer(
        tmp_path, devices=2, strategy=strategy if boosted else "ddp_spawn", logger=False,
        enable_checkpointing=False, max_epochs=3, limit_train_batches=8,
        callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1), BoostReport(console=False)],
    )  # fmt: skip
    trainer.fit(FineTunedRanks(str(tmp_path)), datamodule=BoringDataModule(length=256, batch_size=8))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    same = ranks[0]["weights"] == ranks[1]["weights"]
    assert same is boosted
    assert ranks[0]["averaged"] == ([2] if boosted else [])  # the backbone's weight and bias
    assert ranks[0]["apart"] == ([] if boosted else [2])


class UnusedInBackbone(FineTunedRanks):
    """`FineTunedRanks` whose backbone also holds a layer its forward never uses (a head kept
    for later), trained with AdamW's weight decay; each rank writes that layer's weights and
    whether it has a gradient."""

    def __init__(self, out: str) -> None:
        super().__init__(out)
        self.backbone.append(torch.nn.Linear(16, 16))  # after the ReLU: never called below
        self.initial = self.backbone[2].weight.detach().clone()

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        features = self.backbone[1](self.backbone[0](inputs))
        return torch.nn.functional.mse_loss(self.head(features), targets)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=0.1, weight_decay=0.5)

    @override
    def on_train_end(self) -> None:
        unused = self.backbone[2].weight
        record = {
            "moved": (unused.detach() - self.initial).abs().max().item(),
            "grad": unused.grad is not None,
        }
        Path(self.out, f"rank{self.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.ddp
def test_a_late_parameter_no_rank_uses_keeps_no_gradient_as_under_ddp(tmp_path: Path) -> None:
    """A parameter unfrozen after DDP wrapped the model and used on no rank: the preset's
    all-reduce gave it a zero gradient, so AdamW's weight decay moved a layer the model never
    used (as single-process training and DDP's own reducer leave it: no gradient, not stepped).
    Its gradient stays ``None`` now; one that some rank used is averaged as before."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    strategy = preset("fast-ddp", hardware=EXAMPLES["cpu"], precision="32-true", start_method="spawn")
    trainer = tiny_trainer(
        tmp_path, devices=2, strategy=strategy, logger=False, enable_checkpointing=False, max_epochs=2,
        limit_train_batches=4, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
    )  # fmt: skip
    trainer.fit(UnusedInBackbone(str(tmp_path)), datamodule=BoringDataModule(length=128, batch_size=8))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks == [{"moved": 0.0, "grad": False}] * 2


class _RecordAutocast(BoringModel):
    """Records the dtype a Linear computes in, and the speed flags, inside the training step."""

    seen: tuple[str, torch.dtype, str, bool] | None = None

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self(batch[0])
        flags = (torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark)
        self.seen = (out.device.type, out.dtype, *flags)
        return super().training_step(batch, batch_idx)


@pytest.mark.gpu
def test_on_cuda_the_preset_trains_in_its_precision_with_tf32_and_cudnn_benchmark(tmp_path: Path) -> None:
    if torch.cuda.device_count() > 1:
        pytest.skip("planned for one GPU: on more, preset('auto') picks DDP")
    hardware = HardwareInfo.detect()
    strategy = preset("auto")  # one GPU: a single-device strategy on cuda:0
    plan = strategy.plan
    assert plan.precision == ("bf16-mixed" if hardware.supports_bf16 else "16-mixed")
    assert plan.tf32 == hardware.supports_tf32 and plan.cudnn_benchmark
    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark)
    model = _RecordAutocast()
    trainer = tiny_trainer(tmp_path, accelerator="gpu", devices=1, strategy=strategy)
    trainer.fit(model, datamodule=BoringDataModule())
    half = torch.bfloat16 if plan.precision == "bf16-mixed" else torch.float16
    assert model.seen == ("cuda", half, "high" if plan.tf32 else before[0], True)
    assert trainer.precision == plan.precision
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark) == before


def test_a_preset_planned_for_the_gpu_beside_a_cpu_trainer_says_how_to_plan_for_the_cpu(
    tmp_path: Path,
) -> None:
    # Simulated: the H100's plan (cuda:0), here where no GPU is. On the GPU machine Lightning said
    # only "Device should be CPU, got cuda:0 instead."
    model = BoringModel()
    before = model.layer.weight.detach().clone()
    trainer = tiny_trainer(tmp_path, strategy=preset("auto", hardware=EXAMPLES["h100"]))
    with pytest.raises(ValueError, match=r"accelerator='cpu'.*hardware=HardwareInfo.detect\(\).on_cpu\(\)"):
        trainer.fit(model, datamodule=BoringDataModule())
    assert torch.equal(model.layer.weight, before)  # nothing trained
    planned = preset("auto", hardware=EXAMPLES["h100"].on_cpu())
    assert planned.plan.options["device"] == "cpu" and planned.plan.precision == "32-true"
