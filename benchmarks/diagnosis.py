"""Diagnosis accuracy of SyncGuard and LossLoggingGuard on the corpus of Lightning programs.

Each program (`benchmarks.corpus`) runs clean and with planted mistakes, on the CPU, every step
checked; a finding in the user's code is true when it is on a planted line, false otherwise, and
a planted line without a finding is missed. The ratio is true / (true + false + missed).
"""

from __future__ import annotations

import tempfile

from benchmarks.common import Row
from benchmarks.corpus import PROGRAMS, Diagnosis, diagnose

COMMAND = "python -m benchmarks diagnosis"


def diagnoses() -> list[Diagnosis]:
    results = []
    for program in PROGRAMS:
        for planted in (False, True):
            with tempfile.TemporaryDirectory() as root:
                results.append(diagnose(program, planted, root))
    return results


def run() -> list[Row]:
    results = diagnoses()
    true, false, missed = (
        sum(len(getattr(r, kind)) for r in results) for kind in ("true", "false", "missed")
    )
    wrong = [f"{r.program}{' (planted)' if r.planted else ''}" for r in results if r.false or r.missed]
    detail = (
        f"{len(PROGRAMS)} programs ({', '.join(PROGRAMS)}), each clean and planted, on the CPU"
        f" modelling a GPU run: {true} true, {false} false, {missed} missed findings"
        + (f"; wrong on {', '.join(wrong)}" if wrong else "")
    )
    return [
        Row(
            "diagnosis: guards' findings right / all (target 1.00)",
            true / max(true + false + missed, 1),
            detail,
            COMMAND,
        )
    ]
