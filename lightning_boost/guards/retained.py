"""What a run keeps of its step values, as plain records: who holds graphs, how many, the fix.

A `Holder` is one place that keeps autograd graphs between steps (an attribute of the module, a
value `training_step` returns besides the loss, a tensor passed to a logger),
with the samples taken at checked steps. `holder_fix` and `unnamed_growth_fix` say what to do,
preferring the ways that keep a number without waiting for the GPU. No Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from lightning_boost.guards.graphs import Footprint, Growth, growth, thin
from lightning_boost.guards.sources import Site

#: Where a holder keeps its graphs.
KINDS = ("attribute", "output", "logger")

_SYNC_FREE = (
    "Keep a number without waiting for the GPU: log it with `self.log(name, value)` (Lightning"
    " detaches it and averages on the device), or store `value.detach()`. For a figure per epoch,"
    ' update a `torchmetrics.MeanMetric(nan_strategy="disable")` every step and read `.compute()`'
    " once per epoch (its default NaN check calls `.item()` on every update). Calling `.item()`"
    " every step also works, but makes the CPU wait for the GPU each time."
)


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``.

    Example:
        >>> format_bytes(512), format_bytes(3 * 2**20)
        ('512 B', '3.0 MiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def holder_fix(kind: str, name: str, scalar: bool, keeps_activations: bool = False) -> str:
    """The fix for a holder of `kind` (one of `KINDS`) named `name`.

    `scalar` is for one-element values (losses, metrics); `keeps_activations` for graphs no
    backward pass went through (a side computation), whose saved tensors are still alive.

    Example:
        >>> holder_fix("output", 'training_step()["logits"]', False)[:60]
        'Lightning detaches only the `loss` that `training_step` retu'
    """
    if kind == "output":
        return (
            "Lightning detaches only the `loss` that `training_step` returns: return the other values"
            ' detached (`{"loss": loss, "logits": logits.detach()}`), so whatever keeps the outputs'
            " (a callback's `on_train_batch_end`, a list of step outputs) keeps plain tensors."
        )
    if kind == "logger":
        return (
            "Log with `self.log(name, value)` instead (detached, averaged on the device), or pass"
            " `value.detach()` to the logger."
        )
    if keeps_activations:
        fix = (
            "Compute values that are not part of the loss under `torch.no_grad()` (or keep"
            " `.detach()`ed ones): a graph no backward pass went through keeps its activations."
        )
        fix += f" {_SYNC_FREE}" if scalar else ""
    else:
        fix = _SYNC_FREE if scalar else "Keep `.detach()`ed tensors: the graph is of no use after the step."
    attribute = name.removeprefix("self.")
    return (
        f"{fix} If this module carries the graph across steps on purpose (truncated BPTT), mark it:"
        f' `LossLoggingGuard(allow=["{attribute}"])`.'
    )


def unnamed_growth_fix() -> str:
    """The fix for graphs that grow in number while no attribute, output or logged value holds them."""
    return (
        "No attribute of the module, returned value or logged value holds them: look outside the"
        " LightningModule (a callback's list, a module-level variable, a closure) for values kept"
        " from each step, and keep `.detach()`ed ones there."
    )


class HolderSample(NamedTuple):
    """What one check found in a holder."""

    step: int
    graphs: int
    nodes: int
    saved_bytes: int
    held_bytes: int


@dataclass
class Holder:
    """One place that keeps autograd graphs between steps, and what was seen there.

    Args:
        name: how users write it: ``self.losses``, ``training_step()["logits"]``,
            ``CSVLogger.log_metrics("loss")``.
        kind: one of `KINDS`.
        scalar: whether the values held have one element (losses, metrics).
        sites: the user's lines that store into it.
        paths: up to three example paths to graph-holding tensors, from the last check.
        samples: a `HolderSample` at each check that found it (thinned to a bounded count).
    """

    name: str
    kind: str
    scalar: bool = True
    sites: list[Site] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    samples: list[HolderSample] = field(default_factory=list)

    def add(self, step: int, paths: list[str], found: Footprint) -> None:
        self.paths = paths[:2] + paths[-1:] if len(paths) > 3 else paths
        sample = HolderSample(step, found.graphs, found.nodes, found.saved_bytes, found.held_bytes)
        self.samples = thin([*self.samples, sample])

    def growth(self, measure: str) -> Growth:
        """Growth of one measure (``"graphs"``, ``"nodes"``, ``"saved_bytes"``) over the checked steps."""
        return growth([(s.step, float(getattr(s, measure))) for s in self.samples])

    @property
    def last(self) -> HolderSample:
        return self.samples[-1]

    def title(self) -> str:
        graphs = self.last.graphs
        if self.kind == "output":
            key = self.name.removeprefix("training_step()")
            return f"`training_step` returns `{key}` with its autograd graph"
        if self.kind == "logger":
            return f"A tensor with an autograd graph was passed to `{self.name}`"
        title = f"`{self.name}` keeps {graphs} autograd graph{'s' if graphs != 1 else ''} alive"
        graphs_growth, nodes_growth = self.growth("graphs"), self.growth("nodes")
        if graphs_growth.per_step > 0 and graphs_growth.last > graphs_growth.first:
            return f"{title}, +{graphs_growth.per_step:.3g} per step"
        if nodes_growth.per_step > 0 and nodes_growth.last > nodes_growth.first:
            return f"{title}, growing by {nodes_growth.per_step:.3g} autograd nodes per step"
        return title

    def detail(self) -> str:
        step, _, nodes, saved, held = self.last
        first = self.samples[0].step
        seen = f"at step {first}" if first == step else f"from step {first} to step {step}"
        kept = f"{nodes} autograd nodes and {format_bytes(saved)} of saved tensors (activations)"
        text = f"Found {seen} (checked steps), e.g. {', '.join(self.paths)}."
        return f"{text} Together they keep {kept} alive, plus {format_bytes(held)} in the tensors themselves."

    def fix(self) -> str:
        return holder_fix(self.kind, self.name, self.scalar, keeps_activations=self.last.saved_bytes > 0)

    def to_data(self) -> dict[str, Any]:
        step, graphs, nodes, saved, held = self.last
        return {
            "holder": self.name,
            "kind": self.kind,
            "paths": self.paths,
            "graphs": graphs,
            "graphs_per_step": round(self.growth("graphs").per_step, 4),
            "nodes": nodes,
            "nodes_per_step": round(self.growth("nodes").per_step, 4),
            "saved_bytes": saved,
            "held_bytes": held,
            "first_step": self.samples[0].step,
            "last_step": step,
            "sites": [site.to_dict() for site in self.sites],
        }
