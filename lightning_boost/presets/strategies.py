"""Lightning Strategy subclasses that carry a `PresetPlan`: its precision, speed flags and findings.

The preset logic is in mixins (`PresetStrategy` and one per kind) so that the same classes exist
on either namespace's strategies: here on ``lightning.pytorch``'s, and in
`lightning_boost.pytorch_lightning` on ``pytorch_lightning``'s (each Trainer accepts only its own).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_boost._lightning import (
    callbacks_of,
    destroy_process_group_at_exit,
    namespace_of,
    trainer_precision_flag,
)
from lightning_boost.presets.autocast import MeasuredAutocast, MeasuredAutocastMixin
from lightning_boost.presets.data_parallel import (
    data_parallel_error,
    data_parallel_finding,
    data_parallel_wrappers,
)
from lightning_boost.presets.late_params import LateParams
from lightning_boost.presets.line_search import line_search_finding, line_searches
from lightning_boost.presets.memory_format import (
    MemoryFormatChoice,
    choose_memory_format,
    memory_format_finding,
)
from lightning_boost.presets.plans import PresetPlan
from lightning_boost.presets.saves import (
    BackgroundSaves,
    SavesLanded,
    copies_saved_files,
    file_readers,
    saves_finding,
)
from lightning_boost.report import BoostWarning, Finding, Severity


def check_precision(user_flag: str, plan: PresetPlan) -> None:
    """Raise when the Trainer's `precision` differs from the preset's.

    Lightning uses a strategy instance's precision plugin and drops the Trainer's `precision`
    without a word, so a conflict is an error rather than a silent choice. ``"32-true"`` is also
    Lightning's default, so it cannot be told from "not given" and never conflicts.

    Raises:
        ValueError: naming both precisions and the fix.
    """
    if user_flag in ("32-true", plan.precision):
        return
    raise ValueError(
        f"Trainer(precision={user_flag!r}) conflicts with preset({plan.name!r}), which carries"
        f" {plan.precision!r} for this hardware, and Lightning would use the strategy's precision."
        f" Pass yours to the preset instead: Trainer(strategy=preset({plan.name!r},"
        f" precision={user_flag!r}))."
    )


def cpu_trainer_error(name: str, device: str) -> str:
    """What a Trainer pinned to the CPU is told about a preset planned for the machine's GPU
    (Lightning's own words would be "Device should be CPU, got cuda:0 instead").

    Example:
        >>> print(cpu_trainer_error("auto", "cuda:0"))
        `strategy=preset('auto')` was planned for cuda:0, ...hardware=HardwareInfo.detect().on_cpu())`...
    """
    return (
        f"`strategy=preset({name!r})` was planned for {device}, the device this machine has, but the"
        " Trainer runs on the CPU (`accelerator='cpu'`). To train on the CPU, plan the preset for it:"
        f" `preset({name!r}, hardware=HardwareInfo.detect().on_cpu())` (from `lightning_boost.hardware"
        f" import HardwareInfo`); to train on {device}, leave out `accelerator='cpu'`."
    )


def apply_speed_flags(tf32: bool, cudnn_benchmark: bool) -> dict[str, Any]:
    """Turn on TF32 matmuls and cudnn.benchmark as asked; return what to put back."""
    saved = {"matmul": torch.get_float32_matmul_precision(), "benchmark": torch.backends.cudnn.benchmark}
    if tf32:
        torch.set_float32_matmul_precision("high")
    if cudnn_benchmark and not torch.are_deterministic_algorithms_enabled():
        torch.backends.cudnn.benchmark = True
    return saved


def restore_speed_flags(saved: dict[str, Any]) -> None:
    torch.set_float32_matmul_precision(saved["matmul"])
    torch.backends.cudnn.benchmark = saved["benchmark"]


def _comparing_namespace() -> str:
    """The top package of the code that compared a strategy with a name (``lightning``,
    ``pytorch_lightning``, ...)."""
    caller = sys._getframe(2)  # past __eq__: the code that compared
    return str(caller.f_globals.get("__name__", "")).split(".")[0]


if TYPE_CHECKING:  # the mixins are typed as the strategy they are mixed into
    _Strategy = Strategy
else:
    _Strategy = object


class PresetStrategy(_Strategy):
    """Base of every preset's strategy: ``.plan`` and ``.findings`` say what it chose and why.

    It checks the Trainer's precision against the preset's when the run starts, and holds the
    speed flags (TF32, cudnn.benchmark) from setup to teardown.
    """

    def __eq__(self, other: object) -> bool:
        """Identity, as for any strategy. But a Trainer first compares the strategy it is given
        with its registered names, and only then checks its class: when that Trainer is of the
        other namespace (``pytorch_lightning``'s, for a preset built on ``lightning``, or the
        reverse), the preset becomes that namespace's strategy, built from the same plan, so
        either Trainer takes ``preset(...)`` as it is."""
        if isinstance(other, str):
            namespace = _comparing_namespace()
            if namespace in ("lightning", "pytorch_lightning") and namespace != namespace_of(self):
                self._become(namespace)
        return self is other

    def _become(self, namespace: str) -> None:
        """Turn into `namespace`'s strategy for the same plan (before any Trainer has used it)."""
        module = "lightning_boost.pytorch_lightning" if namespace == "pytorch_lightning" else __name__
        twin = build(self.plan, importlib.import_module(module).KINDS)
        self.__class__ = type(twin)
        self.__dict__ = twin.__dict__

    __hash__ = object.__hash__

    #: Where the precision plugins come from: the namespace of the strategy class mixed in.
    namespace = "lightning.pytorch"
    #: The namespace's `MeasuredAutocastMixin` plugin, for a CPU's measured bf16 autocast.
    measured_autocast: type[MeasuredAutocastMixin] = MeasuredAutocast
    plan: PresetPlan
    findings: list[Finding]
    _saved_flags: dict[str, Any] | None = None
    #: Whether this fit's checkpoint saves run on a worker thread (`presets.saves`).
    saves_in_background = False
    #: The run's layout of its convolution weights (`presets.memory_format`), once decided.
    memory_format: MemoryFormatChoice | None = None

    @property
    def tuned(self) -> dict[str, Any]:
        """What the preset set, for the report's tuned values (options as ``<kind>.<name>``)."""
        plan = self.plan
        values: dict[str, Any] = {
            "preset": plan.resolved,
            "tf32": plan.tf32,
            "cudnn_benchmark": plan.cudnn_benchmark,
            "background_saves": self.saves_in_background,
        }
        if self.memory_format is not None:
            values["channels_last"] = self.memory_format.channels_last
        values.update({f"{plan.kind}.{key}": value for key, value in plan.options.items()})
        return values

    @override
    def setup_environment(self) -> None:
        module = self.lightning_module
        if module is not None:
            flag = trainer_precision_flag(module.trainer)
            check_precision(flag, self.plan)
            if flag == self.plan.precision and self.plan.measure_autocast:
                self._take_precision_as_set(flag)
            self._check_data_parallel(module)
        if self._saved_flags is None:
            self._saved_flags = apply_speed_flags(self.plan.tf32, self.plan.cudnn_benchmark)
        super().setup_environment()
        destroy_process_group_at_exit()
        plugin = self.precision_plugin
        if isinstance(plugin, MeasuredAutocastMixin):  # every rank keeps rank zero's choice
            plugin.owner = self
        self._start_background_saves()

    def _check_data_parallel(self, module: Any) -> None:
        """Raise for an ``nn.DataParallel`` in the model that cannot run in this run's processes;
        else name any there is (`presets.data_parallel`)."""
        wrappers = data_parallel_wrappers(module)
        error = data_parallel_error(wrappers, module.trainer.world_size, self.plan.name)
        if error is not None:
            raise ValueError(error)
        self.findings = [f for f in self.findings if "data_parallel" not in f.data]
        finding = data_parallel_finding(wrappers)
        if finding is not None:
            self.findings.append(finding)

    def _start_background_saves(self) -> None:
        """Hand checkpoint saves to a worker thread (`presets.saves`) when the plan asks for it, the
        run's checkpoint IO is Lightning's default (one passed in ``plugins`` is left as it is),
        and no logger reads each file as it is saved."""
        self.saves_in_background = False
        default_io = importlib.import_module(f"{self.namespace}.plugins.io").TorchCheckpointIO
        current = self._checkpoint_io
        if not self.plan.background_saves or not (current is None or type(current) is default_io):
            return
        module = self.lightning_module
        readers = file_readers(module.trainer.loggers) if module is not None else []
        if module is not None and copies_saved_files(callbacks_of(module.trainer)):
            readers.append("ModelCheckpoint(save_last='link')")
        self.findings = [f for f in self.findings if "background_saves" not in f.data]
        self.findings.append(saves_finding(readers))
        if not readers:
            saves = BackgroundSaves(self.checkpoint_io)
            self.checkpoint_io = saves
            self.saves_in_background = True
            if module is not None:  # before every other callback's `on_train_end`
                callbacks_of(module.trainer).insert(0, SavesLanded(saves))

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        plugin = self.precision_plugin
        module = self.lightning_module
        if isinstance(plugin, MeasuredAutocastMixin) and module is not None:
            plugin.measure(module.trainer)

    def _lay_out(self, wanted: bool | None) -> None:
        """The model's convolution weights laid out as `wanted` (timed when ``None``), with the
        finding (`presets.memory_format`)."""
        module = self.lightning_module
        choice = None if module is None else choose_memory_format(module.trainer, wanted)
        if choice is None:  # no convolution weights, or laid out already (by hand, an earlier fit)
            return
        self.memory_format = choice
        self.findings = [f for f in self.findings if "channels_last" not in f.data]
        self.findings.append(memory_format_finding(choice))

    def _take_precision_as_set(self, flag: str) -> None:
        """`Trainer(precision=flag)` asked for the precision the preset would time on this CPU
        (bf16 against fp32): it is the user's choice, kept as `preset(precision=flag)` keeps it."""
        self.plan = dataclasses.replace(self.plan, measure_autocast=False)
        self.precision_plugin = precision_plugin(self.plan, self.namespace)
        findings = [f for f in self.findings if not f.data.get("precision")]
        detail = f"set by hand, `Trainer(precision={flag!r})`: kept, not timed against fp32"
        kept = Finding(
            "preset",
            "precision and strategy",
            Severity.INFO,
            f"precision {flag!r}",
            detail,
            data={"precision": flag},
        )
        self.findings = [kept, *findings]

    def _preset_precision(self, plan: PresetPlan) -> Any:
        if plan.measure_autocast:
            return self.measured_autocast()
        return precision_plugin(plan, self.namespace)

    @override
    def teardown(self) -> None:
        """Lightning's teardown (which waits for the background saves: `BackgroundSaves.teardown`),
        then the checkpoint IO and speed flags as they were, even when a save failed."""
        try:
            super().teardown()
        finally:
            if isinstance(self._checkpoint_io, BackgroundSaves):
                self._checkpoint_io = self._checkpoint_io.inner  # later saves (ddp_spawn's) wait
            module = self.lightning_module
            if module is not None and module._trainer is not None:
                callbacks = callbacks_of(module.trainer)
                callbacks[:] = [c for c in callbacks if not isinstance(c, SavesLanded)]
            if self._saved_flags is not None:
                restore_speed_flags(self._saved_flags)
                self._saved_flags = None


class PresetDDP(PresetStrategy):
    """A `DDPStrategy` built by `preset("fast-ddp")`; ``.plan`` and ``.findings`` say what it chose."""

    def __init__(self, plan: PresetPlan) -> None:
        options = dict(plan.options)
        hook = _comm_hook(options.pop("comm_hook"))
        super().__init__(  # type: ignore[call-arg]
            precision_plugin=self._preset_precision(plan),
            ddp_comm_hook=hook,
            **options,
        )
        self.plan, self.findings = plan, list(plan.findings)

    @override
    def model_to_device(self) -> None:
        """The model on its device; laid out channels-last (or not) first when the preset was told
        to by hand, before DDP wraps it: its gradient buckets take the weights' layout then."""
        if self.plan.channels_last is not None:
            self._lay_out(self.plan.channels_last)
        super().model_to_device()  # type: ignore[safe-super]

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        """Lightning's, then a warning at set-up for an LBFGS line search over several processes,
        which can hang the fit with no error (`presets.line_search`)."""
        super().setup_optimizers(trainer)
        self.findings = [f for f in self.findings if "line_search" not in f.data]
        finding = line_search_finding(line_searches(self.optimizers), trainer.world_size)
        if finding is not None:
            self.findings.append(finding)
            rank_zero_warn(f"{finding.title}. {finding.detail} Fix: {finding.fix}", category=BoostWarning)

    def _setup_model(self, model: Module) -> Any:
        """DDP around `model`, noting which parameters its reducer holds (`LateParams`)."""
        self._late = LateParams(model)
        return super()._setup_model(model)

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Lightning's step, with the gradients of parameters unfrozen since DDP wrapped the model
        averaged over the ranks inside the closure, after its backward (`presets.late_params`)."""
        late = getattr(self, "_late", None)
        if late is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def averaged() -> Any:
            result = closure()
            if late.average() and not any("late_parameters" in f.data for f in self.findings):
                self.findings.append(late.finding())
            return result

        return super().optimizer_step(optimizer, averaged, model, **kwargs)


class PresetFSDP(PresetStrategy):
    """An `FSDPStrategy` built by `preset("fsdp")`: sharding, size-based wrapping, mixed precision."""

    def __init__(self, plan: PresetPlan) -> None:
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

        options = dict(plan.options)
        min_params = options.pop("min_num_params")
        plugins = importlib.import_module(f"{self.namespace}.plugins.precision")
        super().__init__(  # type: ignore[call-arg]
            precision_plugin=plugins.FSDPPrecision(plan.precision),
            auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=min_params),
            **options,
        )
        self.plan, self.findings = plan, list(plan.findings)


class PresetSingleDevice(PresetStrategy):
    """A `SingleDeviceStrategy` built by `preset("auto")` on one device, with its precision."""

    def __init__(self, plan: PresetPlan) -> None:
        device = plan.options["device"]
        super().__init__(device=device, precision_plugin=self._preset_precision(plan))  # type: ignore[call-arg]
        self.plan, self.findings = plan, list(plan.findings)

    @override
    def on_train_start(self) -> None:
        """The precision's trial (`PresetStrategy`), then, under the precision it chose, the
        layout of a convolutional model's weights: timed on a CPU, as set by hand elsewhere (on an
        H100 under bf16 NHWC made none of four CNNs faster: `channels_last` in RESULTS)."""
        super().on_train_start()
        if self.plan.channels_last is not None or self.plan.accelerator == "cpu":
            self._lay_out(self.plan.channels_last)

    @override
    def setup_environment(self) -> None:
        device = self.root_device
        if type(self.accelerator).__name__ == "CPUAccelerator" and device.type != "cpu":
            raise ValueError(cpu_trainer_error(self.plan.name, str(device)))
        super().setup_environment()


class PresetDDPStrategy(PresetDDP, DDPStrategy):
    """`DDPStrategy` built by `preset("fast-ddp")`; ``.plan`` and ``.findings`` say what it chose."""


class PresetFSDPStrategy(PresetFSDP, FSDPStrategy):
    """`FSDPStrategy` built by `preset("fsdp")`: sharding, size-based wrapping, mixed precision."""


class PresetSingleDeviceStrategy(PresetSingleDevice, SingleDeviceStrategy):
    """`SingleDeviceStrategy` built by `preset("auto")` on one device, with its precision."""


#: Plan kind -> the strategy class that carries it, on ``lightning.pytorch``.
KINDS: Mapping[str, Callable[[PresetPlan], PresetStrategy]] = {
    "single": PresetSingleDeviceStrategy,
    "ddp": PresetDDPStrategy,
    "fsdp": PresetFSDPStrategy,
}


def build(
    plan: PresetPlan, kinds: Mapping[str, Callable[[PresetPlan], PresetStrategy]] = KINDS
) -> PresetStrategy:
    """The Strategy instance for `plan` (`kinds` picks the namespace's classes)."""
    return kinds[plan.kind](plan)


def precision_plugin(plan: PresetPlan, namespace: str = "lightning.pytorch") -> Any:
    """The precision plugin `plan` carries, from `namespace`'s plugins."""
    plugins = importlib.import_module(f"{namespace}.plugins.precision")
    if plan.precision.endswith("-mixed"):
        return plugins.MixedPrecision(plan.precision, plan.accelerator)
    if plan.precision in ("bf16-true", "16-true"):
        return plugins.HalfPrecision(plan.precision)
    if plan.precision == "64-true":
        return plugins.DoublePrecision()
    return plugins.Precision()


def _comm_hook(name: str | None) -> Any:
    if name is None:
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {
        "bf16_compress": default_hooks.bf16_compress_hook,
        "fp16_compress": default_hooks.fp16_compress_hook,
    }[name]
