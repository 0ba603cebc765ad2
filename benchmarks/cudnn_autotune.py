"""What cudnn.benchmark costs and returns on the demo's model: the ResNet-18 of
`lightning_boost.demo` in bf16 autocast with SGD on a CUDA GPU (issue 32; `AUTOTUNE_MIN_RUN_S`).

Each setting runs in a fresh process (cuDNN's autotuning cache lives for the process), off then
on: the first step at each new training size (64, 128, 256, as AutoBatchSize's trials take them)
and evaluation size (256, 512, 1024), against the median of the next 5 steps. The row's ratio is
the steady step off over on at 256 (above 1: autotuned kernels are faster); its detail gives each
setting's first-step seconds per new shape. The first CUDA process on a fresh machine pays cuDNN's
run-time engine compilation on top; run it twice and read the second. Without a CUDA device it
measures nothing and says so. Run: ``python -m benchmarks cudnn_autotune``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.common import Row

COMMAND = "python -m benchmarks cudnn_autotune"
TRAIN_SIZES = (64, 128, 256)


def _first_and_steady(step: Callable[[], None]) -> list[float]:
    """The first call's seconds and the median of the next 5, the device synced around each."""

    def timed() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    return [timed(), statistics.median(timed() for _ in range(5))]


def probe(benchmark: int) -> dict[str, list[float]]:
    """In this process: {"train"/"eval": [first step s, steady step s, ...] per size}."""
    from lightning_boost.demo import ValidatedResNet18

    torch.backends.cudnn.benchmark = bool(benchmark)
    model = ValidatedResNet18().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    out: dict[str, list[float]] = {"train": [], "eval": []}
    for size in TRAIN_SIZES:
        x, y = torch.randn(size, 3, 32, 32, device="cuda"), torch.randint(10, (size,), device="cuda")

        def train(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        out["train"] += _first_and_steady(train)
    model.eval()
    for size in TRAIN_SIZES:
        x = torch.randn(4 * size, 3, 32, 32, device="cuda")

        def evaluate(x: torch.Tensor = x) -> None:
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                model(x)

        out["eval"] += _first_and_steady(evaluate)
    return out


def _firsts(result: dict[str, list[float]], kind: str) -> str:
    return "/".join(f"{s:.2f}" for s in result[kind][::2])


def run() -> list[Row]:
    if not torch.cuda.is_available():
        print("cudnn_autotune: needs a CUDA device; nothing measured")
        return []
    results = {}
    for flag in (0, 1):
        code = f"import json; from benchmarks.cudnn_autotune import probe; print(json.dumps(probe({flag})))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        results[flag] = json.loads(done.stdout.strip().splitlines()[-1])
    off, on = results[0], results[1]
    detail = (
        f"first step at a new training size {'/'.join(map(str, TRAIN_SIZES))}: on {_firsts(on, 'train')} s,"
        f" off {_firsts(off, 'train')} s; evaluation {'/'.join(str(4 * s) for s in TRAIN_SIZES)}:"
        f" on {_firsts(on, 'eval')} s, off {_firsts(off, 'eval')} s; steady step at 256:"
        f" off {off['train'][-1] * 1000:.1f} ms, on {on['train'][-1] * 1000:.1f} ms"
    )
    name = f"cudnn.benchmark on the GPU: the demo model's steady step off / on at batch {TRAIN_SIZES[-1]}"
    return [Row(f"{name} (above 1: autotuned faster)", off["train"][-1] / on["train"][-1], detail, COMMAND)]
