"""Learning rates a program writes into its optimizer during the fit, from a value of its own.

Lightning's docs warm the rate up by hand in ``optimizer_step``, and many programs do so::

    if self.trainer.global_step < 500:
        for pg in optimizer.param_groups:
            pg["lr"] = min(1.0, (self.trainer.global_step + 1) / 500) * self.hparams.lr

Such a write replaces the rate `AutoBatchSize` scaled for a larger batch with the configured
batch's, and its warm-up, counted in steps, spans more of a run that takes fewer steps. An MLP
tuned from 32 to 4x32 samples per step (its warm-up 100 steps, by hand) ended at 0.72-0.75
validation accuracy against plain's 0.87-0.88 over two seeds. So a run whose program writes
its rates keeps the configured batch (`AutoBatchSize` says why and how to move the warm-up into a
scheduler, which it scales).

A write is an assignment to a param group's ``"lr"`` (or its ``fill_``/``copy_``) whose value does
not read the group's own rates (``pg["lr"] = pg["lr"] * 0.9`` follows a scaled rate), found in
the source of the methods of the program's own classes. Pure: the standard library's `ast`.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterable

#: Methods that run before `AutoBatchSize` scales the rates (or build the object): their writes are
#: the configured rates it scales.
BEFORE_SCALING = frozenset({"__init__", "configure_optimizers", "setup", "configure_model", "prepare_data"})
#: A group's own rates: a value that reads one of them follows the scaled rate.
GROUP_RATES = frozenset({"lr", "initial_lr", "max_lr"})
#: The packages whose classes are not the program's.
FRAMEWORKS = ("lightning", "pytorch_lightning", "torch", "lightning_boost", "torchmetrics", "builtins")


def rate_writers(objects: Iterable[object]) -> list[str]:
    """``Class.method`` of each method of the program's own classes (each object's, outside
    `FRAMEWORKS`) that writes a learning rate of its own into a param group (`writes_rate`)."""
    found: list[str] = []
    for cls in dict.fromkeys(base for item in objects for base in type(item).__mro__):
        if cls.__module__.split(".")[0] in FRAMEWORKS:
            continue
        for name, member in vars(cls).items():
            function = getattr(member, "__func__", member)  # a staticmethod's or classmethod's
            if name in BEFORE_SCALING or not inspect.isfunction(function):
                continue
            if writes_rate(function):
                found.append(f"{cls.__qualname__}.{name}")
    return found


def writes_rate(function: object) -> bool:
    """Whether `function`'s source writes a param group's ``"lr"`` from a value of its own
    (`source_writes_rate`); ``False`` when its source cannot be read."""
    try:
        source = inspect.getsource(function)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False
    return source_writes_rate(source)


def source_writes_rate(source: str) -> bool:
    """Whether `source` reaches the optimizer's ``param_groups`` and assigns a ``"lr"`` (or
    ``fill_``/``copy_`` it) a value that does not read the group's own rates (a hyperparameter's
    ``self.hparams["lr"] = ...`` is not a group's).

    Example:
        >>> source_writes_rate('''
        ... for pg in optimizer.param_groups:
        ...     pg["lr"] = min(1.0, (step + 1) / 500) * self.hparams.lr
        ... ''')
        True
        >>> source_writes_rate('optimizer.param_groups[0]["lr"] = optimizer.param_groups[0]["lr"] * 0.9')
        False
        >>> source_writes_rate('for g in opt.param_groups: g["lr"].fill_(scale * self.lr)')
        True
        >>> source_writes_rate('rate = opt.param_groups[0]["lr"]')
        False
    """
    if "param_groups" not in source:
        return False
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(_is_rate(target) for target in node.targets):
            if not _reads_group_rate(node.value):
                return True
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("fill_", "copy_")
            and _is_rate(node.func.value)
            and not any(_reads_group_rate(argument) for argument in node.args)
        ):
            return True
    return False


def _is_rate(node: ast.AST) -> bool:
    return _group_key(node) == "lr"


def _reads_group_rate(value: ast.AST) -> bool:
    return any(_group_key(node) in GROUP_RATES for node in ast.walk(value))


def _group_key(node: ast.AST) -> str | None:
    """The constant key of a subscript that may be a param group's (not ``self.hparams[...]``)."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)):
        return None
    if isinstance(node.value, ast.Attribute) and node.value.attr in ("hparams", "hparams_initial"):
        return None
    key = node.slice.value
    return key if isinstance(key, str) else None
