"""Five of Lightning's own example programs (`benchmarks.corpus.public`), run with the pack added
the README's way on data made in their own formats: none crashes, and every finding the pack
reports is one this test expects, each checked against what the program does."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest

from benchmarks.corpus.public import PROGRAMS, run
from lightning_boost import BoostReport, Finding, Severity
from tests.conftest import OLD_TORCH_OR_LIGHTNING

# What Lightning and PyTorch themselves say about these programs as written (the GAN's datamodule
# asks for 16 workers and has a val loader but no validation_step; the imagenet example pins memory
# on a CPU; the transformer's epoch is shorter than the logging interval): theirs, not the pack's.
pytestmark = [
    pytest.mark.filterwarnings("ignore:You passed in a `val_dataloader` but have no `validation_step`"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create 16 worker processes"),
    pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator"),
    pytest.mark.filterwarnings(
        "ignore:The number of training batches .* is smaller than the logging interval"
    ),
    pytest.mark.filterwarnings("ignore::lightning_boost.BoostWarning"),  # the findings, checked in the report
]

#: Lightning reads logged training values every `log_every_n_steps`: true of every program here
#: that logs in `training_step`, and reported when one of SyncGuard's sampled steps is a logging one.
LOGGED = ("SyncGuard", Severity.INFO, r"read with `.item\(\)` every `log_every_n_steps`")
#: Where the worker search measures the model faster on fewer threads than the workers leave it
#: (a small step on this 2-CPU machine, some runs and not others), it says so: true when it appears.
THREADS = ("AutoNumWorkers", Severity.INFO, r"^torch.set_num_threads\(\d+\)")
#: A short run's report leaves its plots undrawn when they would cost over 1 % of the fit (checked below).
PLOTS = ("BoostReport", Severity.INFO, r"^Plots skipped: \d+ plot\(s\) would take")

# (source, severity, title pattern) for every finding but the doctor's (the machine's, checked in
# tests/test_doctor.py) and StepTimeMonitor's (its verdict is checked against its own figures).
EXPECTED: dict[str, list[tuple[str, Severity, str]]] = {
    "autoencoder": [
        # MyDataModule(batch_size=32): measured, and kept (the noise scale says 64 teaches less)
        ("AutoBatchSize", Severity.INFO, r"^Batch size 32 \(was 32\)"),
        # `self.log(f"{stage}_loss", loss, on_step=True)` in validation_step: read at every step
        ("SyncGuard", Severity.INFO, r"on_step=True.*validation_step"),
        ("LossLoggingGuard", Severity.INFO, r"^No autograd graph kept"),  # it logs and returns `loss`
    ],
    "backbone_image_classifier": [
        ("AutoBatchSize", Severity.INFO, r"^Batch size 32 \(was 32\)"),
        ("SyncGuard", Severity.INFO, r"on_step=True.*validation_step"),
        ("LossLoggingGuard", Severity.INFO, r"^No autograd graph kept"),
    ],
    "transformer": [
        # loaders passed to `trainer.fit`, and no `batch_size` anywhere: trains as written
        ("AutoBatchSize", Severity.WARN, r"^Batch size not tuned: no `batch_size`"),
        ("AutoNumWorkers", Severity.INFO, r"^train loader at batch \d+: num_workers="),
        ("AutoNumWorkers", Severity.INFO, r"^val loader at batch \d+: num_workers="),
        # torch's nn.Transformer compares the mask with a causal one (`torch.equal`) every call
        ("SyncGuard", Severity.WARN, r"^`output = self.model\(input, target\)` syncs .* in training_step"),
        ("SyncGuard", Severity.WARN, r"^`output = self.model\(input, target\)` syncs .* in validation_step"),
        # the demo Transformer builds its mask on the host and moves it (Lightning's code: INFO)
        ("SyncGuard", Severity.INFO, r"^lightning syncs in `forward` .*training step"),
        ("SyncGuard", Severity.INFO, r"^lightning syncs in `forward` .*validation step"),
        # `self.log("train_loss", loss, prog_bar=True)`: converted after every batch, and the bar reads it
        ("SyncGuard", Severity.INFO, r"step-level `prog_bar=True` value"),
        ("SyncGuard", Severity.INFO, r"progress bar reads the `prog_bar=True` values"),
        ("LossLoggingGuard", Severity.INFO, r"^No autograd graph kept"),
    ],
    "generative_adversarial_net": [
        ("AutoBatchSize", Severity.INFO, r"^Batch size kept as written: manual optimization"),
        ("AutoMicroBatch", Severity.INFO, r"^Training steps are not retried under manual optimization"),
        ("AutoNumWorkers", Severity.INFO, r"^train loader at batch \d+: num_workers="),
        # `z = torch.randn(...)` / `torch.ones(...)` on the host, then `.type_as(imgs)`: one copy
        # each, at four lines (the `valid` line twice: the generator's half and the discriminator's)
        ("SyncGuard", Severity.WARN, r"^`z = z.type_as\(imgs\)` syncs"),
        ("SyncGuard", Severity.WARN, r"^`valid = valid.type_as\(imgs\)` syncs"),
        ("SyncGuard", Severity.WARN, r"^`fake = fake.type_as\(imgs\)` syncs"),
        ("LossLoggingGuard", Severity.INFO, r"^No autograd graph kept"),
    ],
    "imagenet": [
        # 16 images at batch 4: 4 steps, too few to repay a trial
        ("AutoBatchSize", Severity.INFO, r"^Batch size 4 kept as configured: the run is 4 optimizer steps"),
        # train_acc1/5 logged with prog_bar=True; val_acc1/5 too, but validation logs per epoch, so
        # Lightning converts them once, at the epoch's end (no step's sync: `epoch_values`)
        ("SyncGuard", Severity.INFO, r"step-level `prog_bar=True` value.*training step"),
        ("LossLoggingGuard", Severity.INFO, r"^No autograd graph kept"),
    ],
}

#: Lines the guards name in the user's code, per program: each WARN points at one of them.
SYNC_LINES = {"generative_adversarial_net": 4, "transformer": 2}


#: The transformer's syncs are torch's `nn.Transformer` and Lightning's demo model: at the oldest
#: set (torch 2.5.1, Lightning 2.4.0) neither syncs there, and the guards rightly find none.
if OLD_TORCH_OR_LIGHTNING:
    EXPECTED["transformer"] = [
        e for e in EXPECTED["transformer"] if not re.search("forward|self.model", e[2])
    ]
    SYNC_LINES["transformer"] = 0


def _findings(trainers: list[L.Trainer]) -> list[Finding]:
    reports = [c.report for t in trainers for c in t.callbacks if isinstance(c, BoostReport)]
    return [f for report in reports if report is not None for f in report.findings]


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_a_public_program_runs_with_the_pack_and_every_finding_is_true(
    program: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")  # LightningCLI 2.6.6's own calls
    trainers = run(program, tmp_path)  # no exception: the program ran to its end
    assert trainers and all(t.state.finished for t in trainers)
    findings = [f for f in _findings(trainers) if f.source not in ("doctor", "StepTimeMonitor")]
    expected = EXPECTED[program]
    missing = [e for e in expected if not any(_matches(f, e) for f in findings)]
    assert not missing
    allowed = [*expected, LOGGED, THREADS, PLOTS]  # every program here logs in `training_step`
    skipped = [f.data for f in findings if _matches(f, PLOTS)]
    assert all(data["estimated_s"] > 0.01 * data["fit_s"] for data in skipped)
    unexpected = [f for f in findings if not any(_matches(f, e) for e in allowed)]
    assert not unexpected, [(f.source, f.severity, f.title) for f in unexpected]
    warned = {f.location for f in findings if f.source == "SyncGuard" and f.severity is Severity.WARN}
    assert len(warned) == SYNC_LINES.get(program, 0)  # one row per line of the program's own code


@pytest.mark.parametrize("program", ["autoencoder", "generative_adversarial_net"])
def test_the_step_time_verdict_agrees_with_its_own_figures(
    program: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    (finding,) = [f for f in _findings(run(program, tmp_path)) if f.source == "StepTimeMonitor"]
    data: dict[str, Any] = finding.data
    input_bound = data["data_wait_fraction"] > data["threshold"]  # "above which"
    assert (finding.severity is Severity.WARN) == input_bound
    if input_bound:  # torchvision's MNIST holds its images in memory: nothing to decode
        assert "Decode" not in finding.fix and "Transform whole batches" in finding.fix


def _matches(finding: Finding, expectation: tuple[str, Severity, str]) -> bool:
    source, severity, title = expectation
    return finding.source == source and finding.severity is severity and bool(re.search(title, finding.title))
