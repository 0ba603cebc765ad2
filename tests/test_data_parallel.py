"""``nn.DataParallel`` inside a LightningModule: the preset names it with the fix, and stops a
multi-process run it would break before the fit starts.

This machine has no GPU, so a DataParallel here spans none and passes calls through (as torch
builds it on such a machine). The GPUs one spans on a multi-GPU machine are simulated by setting
its ``device_ids`` to what torch would give it there; nothing then runs its forward on them.
"""

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_boost import preset
from lightning_boost.hardware import EXAMPLES
from lightning_boost.presets.data_parallel import (
    Wrapper,
    data_parallel_error,
    data_parallel_finding,
    data_parallel_wrappers,
)
from lightning_boost.report import Finding, Severity
from lightning_boost.testing import BoringDataModule, BoringModel, tiny_trainer


class Wrapped(BoringModel):
    """`BoringModel` whose layer is wrapped as code ported from plain PyTorch wraps it; `gpus`
    simulates the GPUs the wrapper spans."""

    def __init__(self, gpus: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.layer = nn.DataParallel(self.layer)  # type: ignore[assignment]
        self.layer.device_ids = list(gpus)


def finding_of(strategy: object) -> Finding | None:
    found = [f for f in getattr(strategy, "findings") if "data_parallel" in f.data]  # noqa: B009
    assert len(found) <= 1
    return found[0] if found else None


def test_a_dataparallel_in_the_model_is_named_with_the_fix_and_the_run_trains(tmp_path: Path) -> None:
    strategy = preset("auto", hardware=EXAMPLES["cpu"])
    trainer = tiny_trainer(tmp_path, strategy=strategy, limit_train_batches=4, enable_checkpointing=False)
    trainer.fit(Wrapped(), datamodule=BoringDataModule())
    trainer.fit(Wrapped(), datamodule=BoringDataModule())  # a second fit: one finding still
    finding = finding_of(strategy)
    assert finding is not None and finding.severity is Severity.INFO
    assert finding.title == "`self.layer` is a torch.nn.DataParallel (no GPU here)"
    assert "preset('fast-ddp')" in finding.fix and "`layer.module.`" in finding.fix
    assert finding.data == {"data_parallel": ["layer"], "gpus": 0}
    assert trainer.global_step == 4


def test_a_model_without_one_has_no_finding(tmp_path: Path) -> None:
    strategy = preset("auto", hardware=EXAMPLES["cpu"])
    trainer = tiny_trainer(tmp_path, strategy=strategy, limit_train_batches=2, enable_checkpointing=False)
    trainer.fit(BoringModel(), datamodule=BoringDataModule())
    assert finding_of(strategy) is None


def test_only_the_outermost_wrapper_is_named() -> None:
    inner = nn.DataParallel(nn.Linear(2, 2))
    head = nn.DataParallel(nn.Linear(2, 1))
    model = nn.ModuleDict({"net": nn.DataParallel(nn.Sequential(inner)), "head": head})
    assert [w.name for w in data_parallel_wrappers(model)] == ["net", "head"]


@pytest.mark.parametrize(
    ("gpus", "processes", "fails"),
    [
        ((0, 1, 2, 3), 4, True),  # DDP over 4 GPUs, the wrapper over all 4: rank 1 cannot run it
        ((0, 1), 2, True),
        ((0,), 2, True),  # over GPU 0 alone: rank 1's module is on cuda:1
        ((), 2, False),  # no GPU: it passes calls through
        ((0, 1, 2, 3), 1, False),  # one process: slow, but it runs
    ],
)
def test_a_wrapper_over_gpus_stops_a_run_of_several_processes(
    gpus: tuple[int, ...], processes: int, fails: bool
) -> None:
    error = data_parallel_error([Wrapper("net", gpus)], processes, "fast-ddp")
    assert (error is not None) is fails
    if error is not None:
        assert f"trains in {processes} processes" in error and f"cuda:{gpus[0]}" in error
        assert "`self.net = net`" in error
        assert "`net.module.`" in error


def test_the_finding_warns_where_the_wrapper_spans_several_gpus() -> None:
    several = data_parallel_finding([Wrapper("net", (0, 1, 2, 3)), Wrapper("head", ())])
    assert several is not None and several.severity is Severity.WARN
    assert several.title.startswith("`self.net` is a torch.nn.DataParallel over 4 GPUs")
    assert "`self.net`, `self.head`" in several.detail and "DistributedDataParallel" in several.detail
    one = data_parallel_finding([Wrapper("net", (0,))])
    assert one is not None and one.severity is Severity.INFO and "scatter and a gather" in one.title
    assert data_parallel_finding([]) is None


@pytest.mark.ddp
def test_two_processes_stop_together_before_the_first_step(tmp_path: Path) -> None:
    """Real DDP over gloo (2 spawned CPU processes): each rank raises at set-up, the parent gets
    the message, and nothing hangs."""
    strategy = preset("fast-ddp", hardware=EXAMPLES["cpu"], start_method="spawn")
    trainer = tiny_trainer(tmp_path, devices=2, strategy=strategy, logger=False, enable_checkpointing=False)
    with pytest.raises(Exception, match=r"is a torch\.nn\.DataParallel over GPUs \[0, 1\]"):
        trainer.fit(Wrapped(gpus=(0, 1)), datamodule=BoringDataModule(length=64))
    assert trainer.global_step == 0 and not torch.distributed.is_initialized()
