"""Random number generator states saved and put back, so measuring leaves no trace."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore Python's, NumPy's, torch's and (when initialized) CUDA's RNG states on exit.

    Example:
        >>> with preserved_rng():
        ...     _ = torch.rand(3)
    """
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
