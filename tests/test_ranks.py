"""`lightning_boost.ranks`: rank zero decides, every rank gets its value, and a failure reaches
every rank instead of leaving them waiting. The other ranks are modelled by a broadcast that
hands over what rank zero sent (the real gloo path runs in the tuners' 2-process tests)."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_boost.ranks import decided_on_rank_zero, from_rank_zero


class Wire:
    """A broadcast between rank zero and one other rank, run one rank at a time: rank zero's call
    records what it sends, the other rank's call returns it."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        assert src == 0
        if not self.sent:
            self.sent.append(obj)
            return obj
        return self.sent[0]


def test_every_rank_takes_rank_zeros_value() -> None:
    wire = Wire()
    assert from_rank_zero(wire, 8) == 8
    assert from_rank_zero(wire, 3) == 8  # another rank's own value is not used


def test_only_rank_zero_decides_and_every_rank_gets_its_result() -> None:
    wire, calls = Wire(), []

    def decide() -> dict[str, int]:
        calls.append(1)
        return {"num_workers": 4}

    assert decided_on_rank_zero(wire, True, decide) == {"num_workers": 4}
    assert decided_on_rank_zero(wire, False, decide) == {"num_workers": 4}
    assert len(calls) == 1


def test_a_failure_on_rank_zero_is_raised_on_every_rank() -> None:
    wire = Wire()

    def decide() -> int:
        raise OSError("cache unreadable")

    with pytest.raises(OSError, match="cache unreadable"):
        decided_on_rank_zero(wire, True, decide)
    with pytest.raises(RuntimeError, match="rank zero failed while deciding for every rank: OSError: cache"):
        decided_on_rank_zero(wire, False, decide)


def test_without_a_strategy_the_value_is_the_decision() -> None:
    assert decided_on_rank_zero(None, True, lambda: None) is None
