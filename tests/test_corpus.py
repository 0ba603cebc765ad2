"""The guards on small CPU versions of real Lightning programs' shapes (`benchmarks.corpus`):
nothing reported on the clean ones, exactly the planted lines on the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.corpus import PROGRAMS, diagnose
from lightning_boost._lightning import pytorch_lightning_takes_our_callbacks


@pytest.mark.parametrize("planted", [False, True], ids=["clean", "planted"])
@pytest.mark.parametrize("program", PROGRAMS)
def test_findings_are_the_planted_lines_exactly(
    program: str, planted: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # LightningCLI 2.6.6 itself calls a jsonargparse API that jsonargparse 4.53 deprecates; and it
    # warns when pytest's own arguments are in sys.argv beside the ones given to it.
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    monkeypatch.setattr("sys.argv", ["train.py"])
    if program == "finetune" and not pytorch_lightning_takes_our_callbacks():
        pytest.skip("a pytorch_lightning Trainer takes the guards from pytorch-lightning 2.6.0")
    result = diagnose(program, planted, tmp_path)
    assert result.false == frozenset() and result.missed == frozenset()
    assert bool(result.expected) == planted


def test_the_benchmark_counts_every_program() -> None:
    from benchmarks import diagnosis

    assert "diagnosis" in __import__("benchmarks.__main__", fromlist=["BENCHMARKS"]).BENCHMARKS
    assert diagnosis.PROGRAMS == PROGRAMS
