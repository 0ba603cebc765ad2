"""Why the run got its worker settings, in words: the findings of a `WorkerChoice`.

No Lightning here. `lightning_boost.workers.search` decides (`search_workers` returns a frozen
`WorkerChoice`: the setting, every trial, the reason, the seconds, the source); this module says
so. Together they answer "why did this run get N workers?".
"""

from __future__ import annotations

from typing import Any

from lightning_boost.hardware import HardwareInfo
from lightning_boost.report import Finding, Severity, plot_data
from lightning_boost.workers.search import WorkerChoice

_FIXES = {
    "hung": "A worker waited longer than `timeout_s` for one sample batch: look for locks, network calls "
    "or per-worker initialisation in `__getitem__`, or raise `WorkerTuning(timeout_s=...)`.",
    "crashed": "A worker process died: run once with `num_workers=0` to see the dataset's own error, "
    "and check the kernel log (`dmesg`) for the out-of-memory killer.",
    "shared memory exhausted": "Workers hand batches over through /dev/shm: give the container more "
    "(`docker run --shm-size=8g` or `--ipc=host`) or lower the batch size or `prefetch_factor`.",
}


def choice_findings(source: str, choice: WorkerChoice, loader: str = "") -> list[Finding]:
    """The choice with its evidence, and one finding per candidate that failed; `loader` names
    the loader it is for (``"train"``, ``"val"``) in each title."""
    label = f"{loader} loader: " if loader else ""
    label += f"num_workers={choice.num_workers}"
    if choice.num_workers:
        label += f", prefetch_factor={choice.prefetch_factor}"
    measured = "; ".join(
        f"{trial.label}: {trial.samples_per_s:.0f} samples/s" if trial.ok else f"{trial.label}: failed"
        for trial in choice.trials
    )
    detail = {
        "measured": f"Measured {measured}. Tuning took {choice.seconds:.1f} s.",
        "searched": f"Searched on the first epoch's own training steps, {len(choice.trials)} segment(s):"
        f" {measured}. Every segment trained the run; the slower settings cost about"
        f" {choice.seconds:.1f} s against the winner's rate.",
        "cache": "Reused the cached measurement (`retune=True` measures again).",
        "checkpoint": "Restored from the checkpoint; not measured again.",
        "short run": f"Measured {measured}. Tuning took {choice.seconds:.1f} s; a longer run measures"
        " worker counts."
        if choice.trials
        else "Nothing measured: a run this short could not repay it.",
    }.get(choice.source, "")
    startups = [trial.startup_s for trial in choice.trials if trial.ok and trial.num_workers]
    measured_now = choice.source in ("measured", "searched")
    if startups and choice.source == "measured":
        detail += (
            f" Worker start-up (until one batch per worker arrived): {max(startups):.2f} s at most,"
            f" {sum(startups):.1f} s of the tuning in all."
        )
    if choice.consumer_samples_per_s and choice.source == "measured":
        detail += f" The training step alone: {choice.consumer_samples_per_s:.0f} samples/s."
    if choice.skipped and measured_now:
        detail += " Not tried: " + "; ".join(choice.skipped) + "."
    if choice.source == "unmeasurable":
        why = choice.reason.removeprefix("not measured: ")
        return [
            Finding(
                source, "data", Severity.INFO, f"{label}: not measured", why, "Set `num_workers` by hand."
            )
        ]
    fell_back = choice.reason.startswith("fell back") or choice.source == "error"
    data = {**choice.to_dict(), "cost_s": round(choice.seconds, 3)}
    plot = worker_plot(choice) if measured_now else None
    if plot is not None:
        data["plot"] = plot
    findings = [
        Finding(
            source,
            "data",
            Severity.WARN if fell_back else Severity.INFO,
            f"{label}: {choice.reason}",
            detail,
            "Fix the failures below, or set `num_workers` by hand." if fell_back else "",
            data=data,
            cost=f"{choice.seconds:.1f} s tuning" if measured_now else "",
        )
    ]
    for trial in choice.failures:
        kind = trial.error.split(":")[0]
        fix = _FIXES.get(kind, "Run with `num_workers=0` to see the dataset's error.")
        findings.append(
            Finding(source, "data", Severity.WARN, f"{trial.label} dropped: {trial.error}", fix=fix)
        )
    return findings


def worker_plot(choice: WorkerChoice) -> dict[str, Any] | None:
    """Throughput vs ``num_workers`` at the first prefetch factor tried (``None`` under two points)."""
    with_workers = [trial for trial in choice.trials if trial.num_workers]
    base = with_workers[0].prefetch_factor if with_workers else None
    curve: dict[int, float] = {}
    for trial in choice.trials:
        if trial.ok and trial.prefetch_factor in (None, base):
            curve.setdefault(trial.num_workers, round(trial.samples_per_s, 1))
    if len(curve) < 2:
        return None
    return plot_data(
        "workers",
        "DataLoader throughput vs num_workers" + (f" (prefetch_factor={base})" if base else ""),
        "num_workers",
        list(curve),
        {"samples/s": list(curve.values())},
        chosen=choice.num_workers,
    )


def threads_finding(source: str, threads: int, num_workers: int, hardware: HardwareInfo) -> Finding:
    return Finding(
        source,
        "data",
        Severity.INFO,
        f"torch.set_num_threads({threads}) beside {num_workers} DataLoader workers",
        f"A CPU run has {hardware.cpus_per_process} CPUs per process; model threads spinning on the "
        "workers' CPUs slow both down, so the model gets the CPUs the workers leave. Restored at teardown.",
        data={"threads": threads, "num_workers": num_workers},
    )


def open_files_finding(source: str, done: str, hardware: HardwareInfo) -> Finding:
    return Finding(
        source,
        "environment",
        Severity.WARN,
        f"Open-file limit {hardware.open_files_limit} is low for DataLoader workers: {done}",
        "Workers pass each tensor to the main process as a file descriptor; a low limit ends in "
        "'Too many open files'.",
        "Raise it where the job starts: `ulimit -n 65536` (or LimitNOFILE in systemd, --ulimit in docker).",
        data={"open_files_limit": hardware.open_files_limit, "action": done},
    )
