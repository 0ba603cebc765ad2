"""Measurements cached as JSON, keyed by a fingerprint of what they depend on.

A cache file holds ``{"schema_version": 1, "entries": {key: entry}}``. It is written atomically
and never pickled; a file that cannot be read is reported and treated as empty, never fatal.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_boost._files import atomic_write_text

SCHEMA_VERSION = 1

#: Environment variable that moves the cache (default: ``$XDG_CACHE_HOME/lightning_boost``).
CACHE_DIR_ENV = "LIGHTNING_BOOST_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$LIGHTNING_BOOST_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightning_boost``, else ``~/.cache/...``."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightning_boost"


def fingerprint(parts: Mapping[str, Any]) -> str:
    """A short stable key for `parts` (any JSON-ready mapping; key order does not matter).

    Example:
        >>> fingerprint({"a": 1, "b": [2, 3]}) == fingerprint({"b": [2, 3], "a": 1})
        True
    """
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def load_entry(path: Path, key: str) -> tuple[dict[str, Any] | None, str | None]:
    """The entry stored under `key` in the cache file at `path`, and a problem, if the file has one.

    A missing file or key is no problem: ``(None, None)``. A file that is not a cache of this
    schema gives ``(None, "why")`` so the caller can warn and measure again.
    """
    entries, problem = _read(path)
    entry = entries.get(key)
    return (entry if isinstance(entry, dict) else None), problem


def store_entry(path: Path, key: str, entry: Mapping[str, Any]) -> None:
    """Store `entry` under `key`, keeping the file's other entries (an unreadable file is replaced)."""
    entries, _ = _read(path)
    entries[key] = {**entry, "stored": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    document = {"schema_version": SCHEMA_VERSION, "entries": entries}
    atomic_write_text(path, json.dumps(document, indent=2, sort_keys=True) + "\n")


def _read(path: Path) -> tuple[dict[str, Any], str | None]:
    if not path.exists():
        return {}, None
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return {}, f"{path} is not readable JSON ({err})"
    if not isinstance(document, dict) or document.get("schema_version") != SCHEMA_VERSION:
        return {}, f"{path} is not a lightning-boost cache of schema version {SCHEMA_VERSION}"
    entries = document.get("entries")
    if not isinstance(entries, dict):
        return {}, f"{path} has no `entries` mapping"
    return entries, None
