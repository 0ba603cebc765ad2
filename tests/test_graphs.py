"""The pure parts behind LossLoggingGuard: the walk, footprints, growth, sampling, source sites."""

from __future__ import annotations

import itertools
import types
from collections import deque, namedtuple
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_boost.guards.graphs import census, footprint, graph_tensors, growth, thin
from lightning_boost.guards.retained import Holder, holder_fix
from lightning_boost.guards.sampling import Sampler, TimeBudget
from lightning_boost.guards.sources import return_sites, store_sites, user_frame

W = torch.ones(4, requires_grad=True)
Pair = namedtuple("Pair", ["first", "second"])


@dataclass
class State:
    hidden: torch.Tensor
    count: int = 0


def paths(roots: dict[str, object], **kwargs: int) -> list[str]:
    return [path for path, _ in graph_tensors(roots, **kwargs)]


def test_walk_names_every_container_kind() -> None:
    roots = {
        "self.a": [W * 1, (W * 2,), {"k": W * 3, 7: W * 4}],
        "self.b": deque([W * 5]),
        "self.c": State(W * 6),
        "self.d": Pair(W.detach(), W * 7),
        "self.e": types.SimpleNamespace(x=W * 8),
        "self.f": {W * 9},
    }
    assert paths(roots) == [
        "self.a[0]",
        "self.a[1][0]",
        'self.a[2]["k"]',
        "self.a[2][7]",
        "self.b[0]",
        "self.c.hidden",
        "self.d.second",
        "self.e.x",
        "self.f{…}",
    ]


def test_walk_skips_what_holds_no_graph() -> None:
    module = nn.Linear(4, 1)
    with torch.no_grad():
        no_grad = W * 2
    roots = {"m": module, "p": module.weight, "leaf": W, "detached": (W * 2).detach(), "ng": no_grad, "n": 3}
    assert paths(roots) == []


def test_walk_is_bounded_in_depth_items_and_survives_cycles() -> None:
    deep: list[object] = [W * 1]
    for _ in range(5):
        deep = [deep]
    assert paths({"x": deep}) == []  # 6 levels down, deeper than MAX_DEPTH
    assert paths({"x": deep}, max_depth=6) == ["x[0][0][0][0][0][0]"]
    many = [W * i for i in range(10)]
    assert paths({"x": many}, max_items=3) == ["x[7]", "x[8]", "x[9]"]  # the newest items
    loop: list[object] = [W * 1]
    loop.append(loop)
    assert paths({"x": loop}) == ["x[0]"]


def test_footprint_counts_activations_until_backward_frees_them() -> None:
    weight = torch.randn(64, 64, requires_grad=True)
    inputs = torch.randn(32, 64)
    hidden = (inputs @ weight).relu()  # relu saved its output: 32 x 64 float32
    side = hidden.sum()
    kept = footprint([side], exclude=[weight])
    assert kept.saved_bytes == 32 * 64 * 4 + 32 * 64 * 4  # relu's result and mm's input
    assert kept.graphs == 1 and kept.nodes == 4  # sum, relu, mm, AccumulateGrad
    side.backward()
    assert footprint([side], exclude=[weight]).saved_bytes == 0


def test_footprint_counts_shared_graphs_once() -> None:
    base = (W * 2).exp()
    one = footprint([base.sum()])
    both = footprint([base.sum(), base.mean()])
    assert both.saved_bytes == one.saved_bytes and both.nodes == one.nodes + 1


def test_census_finds_tensors_no_walk_could_name() -> None:
    hidden_away = {"deep": [[[[[[W * 42]]]]]]}
    assert any(t is hidden_away["deep"][0][0][0][0][0][0] for t in census())


@pytest.mark.parametrize(
    ("samples", "steady"),
    [
        ([(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)], True),
        ([(1, 1.0), (2, 2.0), (3, 3.0)], False),  # too few
        ([(1, 5.0), (2, 5.0), (3, 5.0), (4, 5.0)], False),  # flat
        ([(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0)], False),  # shrinking
        ([(1, 1.0), (2, 9.0), (3, 1.0), (4, 9.0), (5, 1.0), (6, 9.5)], False),  # sawtooth (epoch resets)
    ],
)
def test_growth_is_steady_only_when_it_tracks_the_step(
    samples: list[tuple[int, float]], steady: bool
) -> None:
    assert growth(samples).steady is steady


def test_thin_keeps_the_span_and_the_bound() -> None:
    samples = [(i, float(i)) for i in range(200)]
    for _ in range(5):
        samples = thin(samples, limit=64)
    assert len(samples) <= 100 and samples[0] == (0, 0.0) and samples[-1] == (199, 199.0)


def test_sampler_spaces_checks_by_their_cost() -> None:
    now = [0.0]
    sampler = Sampler(first=3, budget=0.01, clock=lambda: now[0])
    checked = []
    for step in range(1, 100):
        now[0] += 0.010  # each step takes 10 ms
        if sampler.due(step):
            checked.append(step)
            now[0] += 0.001  # each check 1 ms: 10 % of a step, so one check per 10 steps at 1 %
            sampler.record(step, 0.001)
    assert checked[:4] == [1, 2, 3, 13]  # the first 3 (which time the steps), then every 10th
    assert [b - a for a, b in itertools.pairwise(checked[2:])] == [10] * (len(checked) - 3)
    assert sampler.spent_s == pytest.approx(0.001 * len(checked))


def test_time_budget_waits_until_the_action_fits() -> None:
    now = [0.0]
    budget = TimeBudget(share=0.01, initial_cost_s=0.1, clock=lambda: now[0])
    now[0] = 9.9
    assert not budget.allows()
    now[0] = 10.0
    assert budget.allows()
    budget.spend(0.05)  # cheaper than assumed: the next one comes sooner
    now[0] = 15.0
    assert budget.allows() is True
    budget.spend(0.05)
    assert not budget.allows()


class Stores:
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.stats: dict[str, torch.Tensor] = {}
        self.other = 0

    def step(self, loss: torch.Tensor) -> torch.Tensor:
        self.losses.append(loss)  # line A
        self.stats["acc"] = loss  # line B
        self.other = 1
        return loss * 2  # line C


class MoreStores(Stores):
    def more(self, loss: torch.Tensor) -> None:
        self.losses += [loss]  # line D


def line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(n for n, text in enumerate(lines, 1) if text.endswith(f"# {marker}"))


def test_store_sites_find_appends_item_stores_and_aug_assigns_in_the_class_and_its_bases() -> None:
    assert [s.line for s in store_sites(Stores, "losses")] == [line_of("line A")]
    assert [s.line for s in store_sites(MoreStores, "losses")] == sorted(
        [line_of("line A"), line_of("line D")]
    )
    (site,) = store_sites(Stores, "stats")
    assert site.code == 'self.stats["acc"] = loss  # line B' and site.function == "step"
    assert site.location == f"{__file__}:{line_of('line B')}"
    assert [s.function for s in store_sites(Stores, "other")] == ["step"]  # __init__ only without others


def test_sites_of_classes_without_source_are_empty() -> None:
    namespace: dict[str, object] = {}
    exec("class Dynamic:\n    def f(self):\n        self.x.append(1)\n", namespace)
    assert store_sites(namespace["Dynamic"], "x") == []  # type: ignore[arg-type]


def test_return_sites_and_user_frame() -> None:
    assert [s.line for s in return_sites(Stores, "step")] == [line_of("line C")]
    site = user_frame()
    assert site is not None and site.file == __file__ and site.function == "test_return_sites_and_user_frame"


def test_holder_fixes_match_what_is_held() -> None:
    assert holder_fix("attribute", "self.losses", scalar=True).startswith("Keep a number")
    assert holder_fix("attribute", "self.feats", scalar=False).startswith("Keep `.detach()`ed tensors")
    side = holder_fix("attribute", "self.stats", scalar=True, keeps_activations=True)
    assert side.startswith("Compute values that are not part of the loss under `torch.no_grad()`")
    assert 'allow=["stats"]' in side
    holder = Holder("self.losses", "attribute")
    holder.add(1, ["self.losses[0]"], footprint([W * 1]))
    holder.add(2, ["self.losses[0]", "self.losses[1]"], footprint([W * 1, W * 2]))
    assert holder.title() == "`self.losses` keeps 2 autograd graphs alive, +1 per step"
    assert holder.to_data()["graphs_per_step"] == 1.0
