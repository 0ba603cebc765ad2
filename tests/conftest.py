from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_boost.cache import CACHE_DIR_ENV

pytest_plugins = ["lightning_boost.testing.pytest_plugin"]


@pytest.fixture(autouse=True)
def _private_tuning_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Each test measures into its own cache: no test reads another's (or the user's) results."""
    cache_dir = tmp_path / "lightning_boost_cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(cache_dir))
    yield cache_dir
