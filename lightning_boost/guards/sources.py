"""Where in the user's code something happens: source lines found from a class's source or the stack.

`store_sites` finds the lines of a class that store into an attribute (``self.losses.append(...)``,
``self.total += ...``, ``self.stats["acc"] = ...``); `return_sites` a method's last ``return``
statement; `user_frame` the innermost stack frame outside the libraries. No Lightning here.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

#: Methods that store into the container they are called on.
MUTATORS = frozenset(
    {"append", "appendleft", "extend", "extendleft", "insert", "add", "update", "setdefault", "__setitem__"}
)


@dataclass(frozen=True)
class Site:
    """One line of code: the one location model of the guards (a stack frame, the user's line).

    Args:
        file: the source file's path.
        line: the line number, from 1.
        function: the function it is in.
        code: the line's text, stripped; empty until it is read (a stack frame's is read only
            where it is shown).
    """

    file: str
    line: int
    function: str
    code: str = ""

    @property
    def location(self) -> str:
        """``file:line``, the form editors and terminals link."""
        return f"{self.file}:{self.line}"

    def to_dict(self) -> dict[str, object]:
        return {"location": self.location, "function": self.function, "code": self.code}


def _user_classes(cls: type, stop: tuple[str, ...]) -> Iterator[type]:
    """`cls` and its bases, up to the first class from a module starting with one of `stop`."""
    for klass in cls.__mro__:
        if klass is object or klass.__module__.split(".")[0] in stop:
            break
        yield klass


def _class_functions(klass: type) -> Iterator[tuple[str, ast.AST, str, int]]:
    """``(name, node, file, line offset)`` for each function defined in `klass`'s body."""
    try:
        lines, first = inspect.getsourcelines(klass)
        file = inspect.getsourcefile(klass) or inspect.getfile(klass)
    except (OSError, TypeError):  # defined in a REPL or exec(): no source to read
        return
    tree = ast.parse(textwrap.dedent("".join(lines)))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node, file, first - 1


def _rooted_at(expr: ast.expr, attribute: str) -> bool:
    """Whether `expr` is ``self.<attribute>`` or something inside it (``self.x[0].y``)."""
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        inner = expr.value
        if isinstance(expr, ast.Attribute) and isinstance(inner, ast.Name) and inner.id == "self":
            return expr.attr == attribute
        expr = inner
    return False


def _stores(node: ast.AST, attribute: str) -> bool:
    if isinstance(node, ast.Assign):
        return any(_rooted_at(target, attribute) for target in node.targets)
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return node.value is not None and _rooted_at(node.target, attribute)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in MUTATORS and _rooted_at(node.func.value, attribute)
    return False


def _sites(
    cls: type, stop: tuple[str, ...], match: Callable[[str, ast.AST], bool], skip_init: bool = True
) -> list[Site]:
    sites: dict[tuple[str, int], Site] = {}
    init_sites: dict[tuple[str, int], Site] = {}
    for klass in _user_classes(cls, stop):
        for name, function, file, offset in _class_functions(klass):
            for node in ast.walk(function):
                if isinstance(node, (ast.stmt, ast.expr)) and match(name, node):
                    line = node.lineno + offset
                    site = Site(file, line, name, linecache.getline(file, line).strip())
                    (init_sites if name == "__init__" and skip_init else sites)[(file, line)] = site
    return sorted((sites or init_sites).values(), key=lambda s: (s.file, s.line))


LIBRARIES = (
    "lightning",
    "torch",
    "torchmetrics",
    "torchvision",
    "lightning_boost",
    "pytorch_lightning",
    "lightning_fabric",
)


def store_sites(cls: type, attribute: str, stop: tuple[str, ...] = LIBRARIES) -> list[Site]:
    """The lines of `cls` (and its own bases) that store into ``self.<attribute>``.

    Lines in ``__init__`` (which usually create the empty container) are returned only when
    there are no others.

    Example::

        class Model(L.LightningModule):
            def __init__(self):
                self.losses = []                 # not returned: there is a line outside __init__
            def training_step(self, batch, batch_idx):
                ...
                self.losses.append(loss)         # store_sites(Model, "losses") -> this line
    """
    return _sites(cls, stop, lambda _, node: _stores(node, attribute))


def return_sites(cls: type, function: str, stop: tuple[str, ...] = LIBRARIES) -> list[Site]:
    """The last ``return`` statement with a value of `cls`'s method `function` (in a list, empty if none)."""
    return _sites(
        cls,
        stop,
        lambda name, node: name == function and isinstance(node, ast.Return) and node.value is not None,
        skip_init=False,
    )[-1:]


def _library_dirs(names: Iterable[str]) -> tuple[str, ...]:
    dirs = [sysconfig.get_paths()["stdlib"]]
    for name in names:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(str(Path(module.__file__).parent))  # type: ignore[arg-type]
    return tuple(dirs)


def user_frame(frame: FrameType | None = None, libraries: Iterable[str] = LIBRARIES) -> Site | None:
    """The innermost frame of the current stack (or from `frame` outwards) outside `libraries`."""
    frame = frame or sys._getframe(1)
    dirs = _library_dirs(libraries)
    while frame is not None:
        file = frame.f_code.co_filename
        if not file.startswith(dirs) and not file.startswith("<"):
            return Site(
                file, frame.f_lineno, frame.f_code.co_name, linecache.getline(file, frame.f_lineno).strip()
            )
        frame = frame.f_back
    return None
