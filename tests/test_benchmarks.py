import re

import pytest

from benchmarks.__main__ import BEGIN, END, HEADER, parse_spec, update_results
from benchmarks.common import median_ratio

TEMPLATE = (
    f"# Results\n\nintro\n\n{BEGIN}\n{HEADER}\n| old | 1.00x | d | `c` | m | 2026-01-01 |\n{END}\nfooter\n"
)


def test_update_results_replaces_rows_by_name_and_keeps_the_rest() -> None:
    text = update_results(TEMPLATE, {"new": "| new | 2.00x | d | `c` | m | 2026-11-21 |"})
    assert text.startswith("# Results\n\nintro") and text.endswith(f"{END}\nfooter\n")
    assert text.count(HEADER) == 1 and text.count(HEADER.splitlines()[1]) == 1
    assert "| old | 1.00x" in text and "| new | 2.00x" in text
    again = update_results(text, {"old": "| old | 1.50x | d | `c` | m | 2026-11-21 |"})
    assert "| old | 1.50x" in again and "| old | 1.00x" not in again and "| new | 2.00x" in again
    assert again.count(HEADER.splitlines()[1]) == 1


def test_parse_spec_reads_run_arguments_as_literals() -> None:
    assert parse_spec("eval_pass") == ("eval_pass", {})
    assert parse_spec("eval_pass:repeats=1:short=(64,32)") == ("eval_pass", {"repeats": 1, "short": (64, 32)})
    assert parse_spec("checkpoint_saves:cpu=True") == ("checkpoint_saves", {"cpu": True})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("data_bnd", "`NAME` expected one of .* got 'data_bnd'. Did you mean 'data_bound'"),
        ("data_bound:sample=1", "`data_bound's argument` .*got 'sample'. Did you mean 'samples'"),
        ("data_bound:8192", "`data_bound:8192`: write each argument after the name as KEY=VALUE"),
    ],
)
def test_parse_spec_names_what_is_wrong_before_anything_runs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def test_median_ratio() -> None:
    assert median_ratio([3.0, 1.0, 2.0], [1.0, 5.0, 1.0]) == 2.0


def test_data_bound_runs_at_tiny_size() -> None:
    from benchmarks import data_bound

    rows = data_bound.run(samples=128, batch_size=32, repeats=2)  # both orders
    assert [row.benchmark.split(":")[0] for row in rows] == ["data-bound"] * 5
    assert all(row.ratio >= 0 and row.command == data_bound.COMMAND for row in rows)  # 128 images: no search
    assert "warm-cache tuning" in rows[-1].detail


def test_eval_pass_runs_at_tiny_size() -> None:
    from benchmarks import eval_pass

    # 640 images at batch 8: 80 batches, the fewest a pass searches with 2 workers at most, on
    # the CPU (on 16 CPUs the budget's workers need a longer pass); every tuned pass's
    # predictions are checked against plain's inside the benchmark
    rows = eval_pass.run(
        samples=640, batch_size=8, short=(64, 32), repeats=2, accelerator="cpu", max_workers=2
    )  # both orders
    assert [row.benchmark.split(",")[0] for row in rows] == ["predict pass"] * 4
    assert all(row.ratio > 0 and row.command == eval_pass.COMMAND for row in rows)
    assert "searched" in rows[0].detail and "short run" in rows[-1].detail


def test_monitor_overhead_runs_at_tiny_size() -> None:
    from benchmarks import monitor_overhead

    rows = monitor_overhead.run(steps=20, repeats=1)
    names = [row.benchmark.split(":")[0] for row in rows]
    assert names == ["StepTimeMonitor (+ the BoostReport it attaches)", "StepTimeMonitor (+ BoostReport)"]
    assert all(row.ratio > 0 and row.command == monitor_overhead.COMMAND for row in rows)
    assert re.search(r"end-of-fit work .* [0-9]+ ms once per fit", rows[0].detail)
    hook_us = re.search(r"per-step hooks took ([0-9.]+) µs a step", rows[1].detail)
    assert hook_us and float(hook_us.group(1)) > 0  # the hooks were timed, not skipped


def test_report_plots_times_the_plots_of_a_real_report_at_tiny_size() -> None:
    from benchmarks import report_plots

    (row,) = report_plots.run(samples=1024, repeats=1)
    assert row.benchmark.startswith("report plots: BoostReport's estimate of drawing a fit's plots")
    assert row.ratio > 0 and row.command == report_plots.COMMAND
    assert re.search(r"[1-9] plots [0-9.]+ s the first time in a process", row.detail)
    assert "a plot drawn again (PLOT_S" in row.detail


def test_guard_overhead_runs_at_tiny_size() -> None:
    from benchmarks import guard_overhead

    rows = guard_overhead.run(
        steps=20, repeats=1, every_step_steps=5, every_step_repeats=1, loading_steps=3, loading_repeats=1
    )
    assert [row.benchmark.split(":")[0] for row in rows] == [
        "LossLoggingGuard default (first 3 steps, then 0.5 % budget)",
        "LossLoggingGuard default",
        "LossLoggingGuard every step (every_n_steps=1, GC scan each step)",
        "SyncGuard default (first 3 steps, then 0.5 % budget)",
        "SyncGuard default",
        "SyncGuard every step (every_n_steps=1)",
        "SyncGuard every step, images loaded in the run's process",
    ]
    assert all(row.ratio > 0 and row.command == guard_overhead.COMMAND for row in rows)


def test_micro_batch_runs_at_tiny_size() -> None:
    from benchmarks import micro_batch

    overhead, retry = micro_batch.run(steps=20, repeats=1, retry_repeats=1, retry_steps=3)
    assert overhead.ratio > 0 and retry.ratio > 0 and retry.command == micro_batch.COMMAND
    assert "same weights at the end in 1 of 1 pairs" in retry.detail


def test_channels_last_row_names_the_preset_s_decision_at_tiny_size() -> None:
    import torch

    from benchmarks import channels_last

    row = channels_last._row("small CNN", channels_last.MODELS["demo's small CNN"], steps=2, repeats=1)
    # the preset times the layout on one CPU device; on a GPU it keeps the model as built (NCHW)
    on_gpu = torch.cuda.is_available()
    where = " on a GPU" if on_gpu else ""
    assert row.benchmark == f"channels_last{where}, small CNN: NCHW step time / NHWC" and row.ratio > 0
    decided = "does not time it on this device (NCHW)" if on_gpu else "the preset's trial kept N"
    assert decided in row.detail and row.command == channels_last.COMMAND


def test_time_to_quality_row_is_the_median_pair_at_tiny_size() -> None:
    from benchmarks import time_to_quality

    tiny = time_to_quality.Workload(
        "tiny", time_to_quality.MLP, lambda: time_to_quality.classes(512, 0),
        lambda: time_to_quality.classes(128, 1), 1, "val accuracy",
    )  # fmt: skip
    row = time_to_quality._row(tiny, pairs=3)
    assert row.benchmark == "time to quality (tiny)" and row.command == time_to_quality.COMMAND
    ratios = row.detail.split("(ratios ")[1].split(")")[0].split(", ")
    assert len(ratios) == 3 and ratios == sorted(ratios, key=float) and f"{row.ratio:.2f}" == ratios[1]
    assert "median of 3 alternating pairs" in row.detail and "the median pair reached" in row.detail
    assert time_to_quality._finals([0.5, 0.25]) == "0.5, 0.25"
    with pytest.raises(ValueError, match=r"only.*'mlp'"):  # one workload, named as its rows name it
        time_to_quality.run(only="mpl")


def test_stack_overhead_runs_at_tiny_size_and_names_the_run_s_decisions() -> None:
    from benchmarks import stack_overhead

    rows = stack_overhead.run(steps=30, repeats=1, from_step=10)
    assert [row.benchmark.split(":")[0] for row in rows] == [
        "README set-up (boost_callbacks() + preset('auto')), once decided",
        "README set-up, once decided",
    ]
    assert all(row.ratio > 0 and row.command == stack_overhead.COMMAND for row in rows)
    assert "precision 32-true" in rows[0].detail or "bf16" in rows[0].detail
    assert "workers" in rows[0].detail and "6 callbacks that do nothing" in rows[0].detail


def test_demo_workloads_run_at_tiny_size() -> None:
    from benchmarks import compute_bound, demo_workload

    (demo,) = demo_workload.run(samples=64, epochs=1, repeats=2, batch_size=16)
    (resnet,) = compute_bound.run(samples=64, epochs=1, repeats=1, batch_size=32)
    assert demo.ratio > 0 and resnet.ratio > 0 and resnet.command == compute_bound.COMMAND
    assert "wall time with tuning" in demo.detail and "resnet18" in resnet.detail


def test_cold_demo_benchmark_runs_at_tiny_size_with_a_fresh_cache_each(tmp_path, monkeypatch) -> None:
    from benchmarks import demo_cold
    from lightning_boost.cache import CACHE_DIR_ENV

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "kept"))
    sooner, wall, before = demo_cold.run(repeats=1, samples=128, epochs=1)
    assert sooner.benchmark.startswith("time to quality (`make demo`, cold cache)")
    assert wall.ratio > 0 and 0 < before.ratio < 1 and before.command == demo_cold.COMMAND
    assert "cold cache each, 1 repeats" in sooner.detail
    assert not (tmp_path / "kept").exists()  # the user's cache is neither read nor written


def test_noise_scale_benchmark_runs_at_tiny_size() -> None:
    from benchmarks import noise_scale

    row, crossed, accelerator, gpu = noise_scale.run(
        draws=1, samples=256, size=16, gradients=4, sizes=(8, 16), arch="resnet18", image=32
    )
    assert 0 <= row.ratio <= 1 and "1 draws" in row.detail and row.command == noise_scale.COMMAND
    assert crossed.ratio in (0.0, 0.5, 1.0) and "4 gradients per size" in crossed.detail
    assert "8: |E g|^2" in crossed.detail and "16: |E g|^2" in crossed.detail
    assert accelerator.ratio in (0.0, 1.0) and "reading 4 independent batches'" in accelerator.detail
    assert 0 <= gpu.ratio <= 1 and "resnet18 at 32 px" in gpu.detail and "x2 limit is 128" in gpu.detail


def test_grown_workers_benchmark_fits_each_way_at_tiny_size() -> None:
    from benchmarks import grown_workers

    (row,) = grown_workers.run(rounds=1, epochs=2, samples=1024)
    assert row.ratio > 0 and row.command == grown_workers.COMMAND
    finals = re.findall(r"\((?:final val acc, workers at 128: )?(0\.\d+), 0\)", row.detail)
    assert len(finals) == 3 and len(set(finals)) == 1  # 32 batches an epoch: none searched, the same fits


def test_growth_moments_benchmark_rescales_at_each_growth_at_tiny_size() -> None:
    from benchmarks import growth_moments

    rescaled, kept = growth_moments.run(seeds=1, epochs=3)
    assert rescaled.ratio > 0 and kept.ratio > 0 and rescaled.command == growth_moments.COMMAND
    factors = rescaled.detail.split("rescaled at each growth (x")[1].split(")")[0].split(", ")
    assert len(factors) == 2 and all(0.3 < float(f) < 1 for f in factors)  # mostly noise: about 1/2
    assert "state left as it was" in kept.detail


def test_batch_quality_benchmark_runs_at_tiny_size() -> None:
    from benchmarks import batch_quality

    linear, root = batch_quality.run(samples=256, epochs=1, sizes=(128,), seeds=(0, 1))
    assert linear.ratio > 0 and root.ratio > 0 and linear.command == batch_quality.COMMAND
    assert "seeds 0, 1" in linear.detail and linear.detail.count("(") >= 3  # each seed beside the mean
    assert "batch 128 at lr 0.1:" in linear.detail and "batch 128 at lr 0.0707107:" in root.detail
    assert "square-root lr (x1.41)" in root.benchmark


def test_batch_size_benchmark_runs_at_tiny_size() -> None:
    """On the CPU, on a GPU machine too: a 0.25 GiB budget is the CPU's scale (on an H200 no size
    of the ResNet-18 fits it, and the search halves to 1, where its BatchNorm cannot train)."""
    from benchmarks import batch_size

    (row,) = batch_size.run(
        budget_gib=0.25, largest=16, rounds=1, samples=64, tune_samples=1024, accelerator="cpu"
    )
    assert row.ratio > 0 and "BatchSizeFinder: 64" in row.detail  # it grows to the dataset's length
    assert " 0 sizes" not in row.detail and "kept" not in row.detail  # AutoBatchSize measured sizes


def test_worker_replay_rows_hold_the_targets() -> None:
    from benchmarks import worker_replay

    measured, made_up, online, online_made_up = worker_replay.run()
    assert measured.benchmark == "worker_replay (measured)" and measured.ratio >= 0.95
    assert made_up.benchmark == "worker_replay (made-up)" and made_up.ratio >= 0.95
    # the search on the run's own batches, under the contention model (issue 30's target); the
    # made-up machines' worst is 2 CPUs whose two settings differ by 10 %, the noise itself
    assert online.benchmark == "worker_replay (online, measured + contention)" and online.ratio >= 0.95
    assert online_made_up.ratio >= 0.89
    assert "3 seeded cold runs" in measured.detail


def test_fast_dev_run_benchmark_runs_and_writes_nothing() -> None:
    from benchmarks import fast_dev_run

    (row,) = fast_dev_run.run(pairs=1)
    assert row.ratio > 0 and "files written: 0" in row.detail


def test_the_cudnn_autotune_benchmark_says_it_needs_cuda(capsys) -> None:
    import torch

    from benchmarks import cudnn_autotune

    if torch.cuda.is_available():  # there it measures (`python -m benchmarks cudnn_autotune`)
        return
    assert cudnn_autotune.run() == []
    assert "needs a CUDA device" in capsys.readouterr().out


def test_the_checked_steps_benchmark_reads_both_first_segments() -> None:
    """The path at a tiny size, not the figure: one fit of each kind, and the instrumented count
    is put back."""
    from benchmarks import checked_steps
    from lightning_boost import instrumented

    count = instrumented.count
    (row,) = checked_steps.run(fits=1, workload="mlp", accelerator="cpu", max_workers=2)  # any machine
    assert row.ratio > 0 and row.command == checked_steps.COMMAND and instrumented.count is count
    assert re.search(r"first segment [\d,]+ samples/s \([\d,]+; [01] of 1 kept", row.detail)


def test_the_checkpoint_saves_benchmark_compares_the_two_settings(monkeypatch) -> None:
    """The path at a tiny size, not the figure: both settings fit, and the training thread's time
    in saves is measured for each."""
    from benchmarks import checkpoint_saves

    (row,) = checkpoint_saves.run(samples=256, epochs=1, pairs=1, cpu=True)
    assert row.ratio > 0 and row.command == checkpoint_saves.COMMAND
    assert re.search(r"the training thread spent \d+\.\d+ s against \d+\.\d+ s in 4 saves", row.detail)


def test_the_gpu_batch_size_benchmark_runs_at_tiny_size_on_the_cpu(tmp_path, monkeypatch) -> None:
    """Issue 32's ResNet-50 comparison, here with a small model and images: the path, not the figure."""
    from benchmarks import gpu_batch_size
    from lightning_boost.cache import CACHE_DIR_ENV

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    speed, tuning, goodput = gpu_batch_size.run(
        arch="resnet18", image=16, max_batch_size=64, steps=5, workers=0, samples=1024, cpu=True
    )
    assert speed.ratio > 0 and tuning.ratio > 0 and speed.command == gpu_batch_size.COMMAND
    assert "AutoBatchSize: batch" in speed.detail and "BatchSizeFinder(binsearch): batch" in speed.detail
    assert "(trials 32: " in speed.detail and "; noise scale " in speed.detail  # the decision, and why
    assert "the process's CUDA start-up before both (" in speed.detail
    assert goodput.ratio > 0 and goodput.detail.startswith("goodput ")


@pytest.mark.ddp
def test_ddp_row_pairs_the_preset_with_plain_ddp_at_tiny_size() -> None:
    from benchmarks import ddp

    preset, flags = ddp.run(samples=512, epochs=1, rounds=1)
    assert preset.ratio > 0 and flags.ratio > 0 and preset.command == flags.command == ddp.COMMAND
    assert "plain ran 32-true, DDP's defaults" in preset.detail
    assert "the preset ran 32-true, " in flags.detail  # held at fp32
    assert "gradient_as_bucket_view=True" in preset.detail and "val accuracy plain / preset" in preset.detail


def test_autocast_recheck_runs_at_tiny_size() -> None:
    """On a CPU with bf16 instructions; on one without, where no run keeps bf16, it measures nothing
    (this project's CI hosts have been of both kinds)."""
    from benchmarks import autocast_recheck
    from lightning_boost.hardware import HardwareInfo

    rows = autocast_recheck.run(rounds=1, resnet_samples=128, cnn_samples=128)
    if not HardwareInfo.detect().cpu_supports_bf16:
        assert rows == []
        return
    assert [row.benchmark.rsplit(": ", 1)[1] for row in rows] == [
        "fit time without the checks / with them",
        "fit time in fp32 set by hand / with the checks",
        "fit time without the checks / with them",
    ]
    assert all(row.ratio > 0 and row.command == autocast_recheck.COMMAND for row in rows)
    assert "planted verdict: bf16 1.25x (cache)" in rows[0].detail
    assert "unchecked " in rows[0].detail and " in bf16-mixed (check pairs fp32/bf16: none)" in rows[0].detail
    assert "fp32 " in rows[1].detail and " in 32-true (check pairs fp32/bf16: none)" in rows[1].detail
