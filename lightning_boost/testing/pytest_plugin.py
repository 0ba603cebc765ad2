"""pytest plugin: the ``gpu`` and ``ddp`` markers.

Enable it with ``pytest_plugins = ["lightning_boost.testing.pytest_plugin"]`` in ``conftest.py``.

- ``@pytest.mark.gpu``: needs a CUDA device; skipped, with the reason, where there is none.
- ``@pytest.mark.ddp``: starts 2 CPU processes over gloo; skipped where torch.distributed or
  gloo is missing. Deselect with ``-m "not ddp"`` for a quicker local loop.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

MARKERS = {
    "gpu": "needs a CUDA device (skipped without one)",
    "ddp": "runs 2 CPU processes over gloo",
}


def skip_reason(marker: str) -> str | None:
    """Why a test with `marker` cannot run on this machine, or ``None`` when it can."""
    if marker == "gpu" and not torch.cuda.is_available():
        return "needs a CUDA device; torch.cuda.is_available() is False"
    if marker == "ddp" and not (dist.is_available() and dist.is_gloo_available()):
        return "needs torch.distributed with the gloo backend"
    return None


def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for name in MARKERS:
            reason = skip_reason(name) if item.get_closest_marker(name) else None
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
