"""Small CPU versions of the shapes real Lightning programs take, for diagnosing the guards.

Each program is written here after a public pattern (Lightning's GAN and ImageNet examples, a
fine-tuning module with a frozen backbone, a LightningCLI program, a torchmetrics
``MetricCollection``), none copied. Each has a clean variant and a ``planted`` one whose mistakes
sit on lines ending with ``# planted: <what>``; `diagnose` runs `SyncGuard` and `LossLoggingGuard`
on one and compares what they report in the user's code with those lines.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from lightning_boost import LossLoggingGuard, Severity, SyncGuard

PROGRAMS = ("gan", "imagenet", "finetune", "cli_program", "metric_collection")


@dataclass(frozen=True)
class Diagnosis:
    """What the guards reported in the user's code against what was planted there."""

    program: str
    planted: bool
    expected: frozenset[str]
    found: frozenset[str]

    @property
    def true(self) -> frozenset[str]:
        return self.found & self.expected

    @property
    def false(self) -> frozenset[str]:
        return self.found - self.expected

    @property
    def missed(self) -> frozenset[str]:
        return self.expected - self.found


def planted_lines(file: str | Path) -> frozenset[str]:
    """``file:line`` of every line of `file` marked ``# planted: ...``."""
    path = Path(file).resolve()
    lines = path.read_text().splitlines()
    return frozenset(f"{path}:{n}" for n, text in enumerate(lines, 1) if "# planted:" in text)


def diagnose(program: str, planted: bool, root: str | Path) -> Diagnosis:
    """Run `program` (clean or planted) under both guards, every step checked."""
    module = importlib.import_module(f"benchmarks.corpus.{program}")
    guards = [SyncGuard(mode="report", every_n_steps=1), LossLoggingGuard(mode="report", every_n_steps=1)]
    module.run(planted=planted, root=str(root), callbacks=guards)
    found = set()
    for guard in guards:
        for finding in guard.findings:
            if finding.data.get("framework") or finding.severity is Severity.INFO:
                continue  # Lightning's own (reported apart, with its setting), or an all-clear
            found.add(finding.location or f"{type(guard).__name__}: {finding.title}")
    expected = planted_lines(module.__file__) if planted else frozenset()
    return Diagnosis(program, planted, expected, frozenset(found))
