"""`BoostReport`: the one place a run shows what was tuned, what was found and what it costs."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_boost._lightning import (
    callbacks_of,
    datamodule_of,
    debugging_mode,
    destroy_process_group_at_exit,
    hold_hyperparameters,
    is_lightning,
    skip_unused_batch_hooks,
    user_hyperparameters,
)
from lightning_boost._validation import Directory, validated
from lightning_boost.presets.late_params import LateParams, unaveraged_finding
from lightning_boost.report import BoostWarning, Finding, Report, ReportsFindings, ReportsTuned, make_console
from lightning_boost.report.plots import matplotlib_missing, plot_specs, plots_fit, plots_skipped, write_plots

#: Prefix of the hyperparameters the report logs.
HPARAM_PREFIX = "boost/"


class BoostReport(L.Callback):
    """Collects the findings of the doctor and of every boost part in the run, and shows them once.

    At the end of each fit, on rank zero:

    - a console table grouped by area (environment, data, batch size, precision and strategy,
      syncs, retained graphs, step time), each row with what was found, its cost where measured
      and the fix;
    - ``boost_report.json`` (schema in docs/report.md), ``boost_report.md`` and PNG plots
      (``boost_<name>.png``, with matplotlib) in the run's log directory, when it has a logger
      (with ``logger=False`` nothing is written unless asked: `files` or `dirpath`); a short fit
      leaves the plots to ``lightning-boost plots DIR`` (`plots`);
    - when training starts, the values the run was tuned to (batch size, workers, precision,
      strategy flags) logged as hyperparameters, prefixed ``boost/``, to every logger.

    Findings come from the machine check (`lightning_boost.doctor`), the strategy (a `preset`),
    the datamodule (`BoostedDataModule`) and every callback with a ``findings`` list, read on rank
    zero. Every boost callback attaches one `BoostReport` to its trainer when there is none, so
    passing it yourself is only needed to change its options. If the fit fails, the files are
    still written with what was found so far.

    Args:
        console: print the table at the end of fit.
        files: write the JSON, Markdown and plot files: ``None`` (default) where the run keeps
            its logs (its first logger's directory; none without a logger), ``True`` also
            without a logger (in ``default_root_dir``), ``False`` never.
        plots: draw the PNG plots (needs matplotlib: ``pip install 'lightning-boost[plots]'``):
            ``None`` (default) when drawing takes at most 1 % of the fit's wall time (about 0.15 s
            a plot on a 2-CPU host, `lightning_boost.report.plots.drawing_s`), else
            the report says so and ``lightning-boost plots DIR`` draws them later; ``True`` on every
            fit; ``False`` never.
        log_hyperparams: log tuned values to the loggers.
        dirpath: write files here instead of the trainer's log directory (with or without a logger).

    Example::

        trainer = L.Trainer(callbacks=[AutoNumWorkers(), BoostReport(console=False)])
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        skip_unused_batch_hooks(cls)  # as for itself, below the class

    @validated
    def __init__(
        self,
        *,
        console: bool = True,
        files: bool | None = None,
        plots: bool | None = None,
        log_hyperparams: bool = True,
        dirpath: Directory | None = None,
    ) -> None:
        self.console = console
        self.files = files
        self.plots = plots
        self.log_hyperparams = log_hyperparams
        self.dirpath = dirpath
        self.report: Report | None = None
        self.paths: list[Path] = []
        self.tuned_config: Path | None = None
        self._repeat: str | None = None
        self._user_hparams: dict[str, Any] = {}
        self._undo_hold: Callable[[], None] | None = None
        self._fit_started = time.perf_counter()
        #: What it finds itself: parameters Lightning's DDP leaves to each rank (`_check_late`).
        self.findings: list[Finding] = []
        self._late: LateParams | None = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._fit_started = time.perf_counter()  # the fit's wall time prices its plots

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        destroy_process_group_at_exit()  # a DDP run with the pack ends without gloo's exit abort
        self.findings = []  # a new fit's
        self._late = LateParams(pl_module) if _leaves_late_parameters(trainer) else None
        if self.log_hyperparams and trainer.loggers:
            self._user_hparams = user_hyperparameters(trainer)
            self._undo_hold = hold_hyperparameters(trainer)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write_tuned_config(trainer)  # now, so a run that fails still leaves one
        if self.log_hyperparams and trainer.is_global_zero:
            tuned = {HPARAM_PREFIX + key: value for key, value in tuned_values(trainer).items()}
            for logger in trainer.loggers:
                logger.log_hyperparams({**self._user_hparams, **tuned})
                if is_lightning(logger, "TensorBoardLogger"):  # its hparams.yaml was written at fit start
                    save_hparams_to_yaml(Path(str(logger.log_dir), "hparams.yaml"), logger.hparams)  # type: ignore[attr-defined]

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_late(trainer)  # after a fine-tuning callback listed before it unfroze its part

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_late(trainer)  # one listed after it (or a module's own hook)

    def _check_late(self, trainer: L.Trainer) -> None:
        """Warn once when a parameter frozen as DDP wrapped the model trains: Lightning's DDP
        leaves its gradients to each rank (`presets.late_params`; `preset('fast-ddp')` averages)."""
        late = self._late.late() if self._late is not None else []
        if not late:
            return
        self._late = None
        finding = unaveraged_finding(late)
        self.findings.append(finding)
        rank_zero_warn(f"{finding.title}. {finding.detail} Fix: {finding.fix}.", category=BoostWarning)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._undo_hold is not None:
            self._undo_hold()
            self._undo_hold = None

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write_tuned_config(trainer)  # again: workers and precision settle during training
        self._build(trainer)
        if self.console and trainer.is_global_zero and self.report is not None:
            _print(self.report, self.paths[0] if self.paths else None, _console(trainer), self._repeat)

    def _write_tuned_config(self, trainer: L.Trainer) -> None:
        """``config.tuned.yaml`` under LightningCLI, and the line that says how to repeat the run."""
        if not trainer.is_global_zero or self.files is False:
            return
        from lightning_boost.report.tuned_config import NotWritten, repeat_command, write_tuned_config

        try:
            self.tuned_config = write_tuned_config(trainer, tuned_values(trainer))
        except NotWritten as why:
            self.tuned_config, self._repeat = None, str(why)
            return
        if self.tuned_config is not None:
            self._repeat = f"Repeat this run as it trained: {repeat_command(trainer, self.tuned_config)}"

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        try:
            self._build(trainer)
        except Exception as err:  # the user's own exception is the one to see
            rank_zero_warn(
                f"BoostReport could not write the report of the failed run: {err!r}", category=BoostWarning
            )

    def _build(self, trainer: L.Trainer) -> None:
        if not trainer.is_global_zero:
            return
        report = collect_report(trainer)
        self.report, self.paths = report, []
        directory = self._directory(trainer)
        if directory is not None and self.plots is not False:
            self._draw(report, directory)
        if directory is not None:
            self.paths = list(report.write(directory)) + self.paths

    def _draw(self, report: Report, directory: Path) -> None:
        """The report's plots into `directory`, unless nobody asked and they would cost the fit
        more than its budget (`plots_fit`): then a finding says how to draw them later."""
        count, fit_s = len(plot_specs(report.findings)), time.perf_counter() - self._fit_started
        if self.plots is None and not plots_fit(count, fit_s):
            report.add([plots_skipped(type(self).__name__, count, fit_s)])
            return
        try:
            plots = write_plots(report.findings, directory)
        except ModuleNotFoundError:
            report.add([matplotlib_missing(type(self).__name__)])
        else:
            report.plots = [path.name for path in plots]
            self.paths += plots

    def _directory(self, trainer: L.Trainer) -> Path | None:
        """Where the files go, or ``None`` for none: a run without a logger, or one whose logging
        Lightning suppresses (``fast_dev_run``), writes nothing unasked."""
        if self.files is False:
            return None
        if self.dirpath is not None:
            return Path(self.dirpath)
        if debugging_mode(trainer) == "fast_dev_run" and not self.files:
            return None
        if trainer.loggers or self.files:
            return log_dir(trainer)
        return None


skip_unused_batch_hooks(BoostReport)  # its per-batch hooks are Callback's no-ops


def _leaves_late_parameters(trainer: L.Trainer) -> bool:
    """Whether `trainer` trains under a DDP over several processes that averages only the
    parameters trainable when it wrapped the model: Lightning's own (the preset's averages all;
    DeepSpeed, a `DDPStrategy` to Lightning, has an engine of its own)."""
    from lightning_boost.presets.strategies import PresetDDP

    strategy = trainer.strategy
    plain_ddp = is_lightning(strategy, "DDPStrategy") and not isinstance(strategy, PresetDDP)
    return plain_ddp and not is_lightning(strategy, "DeepSpeedStrategy") and trainer.world_size > 1


def attach_report(trainer: L.Trainer) -> None:
    """Add a `BoostReport` to `trainer` unless it has one (`BoostCallback.setup` calls this).

    Lightning runs the ``setup`` hooks of callbacks appended while they run, so the new report
    joins the same fit.
    """
    if not any(isinstance(callback, BoostReport) for callback in callbacks_of(trainer)):
        callbacks_of(trainer).append(BoostReport())


def collect_report(trainer: L.Trainer) -> Report:
    """Every finding in `trainer`'s run (machine, strategy, datamodule, callbacks) and its tuned values."""
    from lightning_boost._lightning import hardware_for
    from lightning_boost.doctor import run_checks

    report = run_checks(hardware_for(trainer))
    for part in [trainer.strategy, datamodule_of(trainer), *callbacks_of(trainer)]:
        if isinstance(part, ReportsFindings) and isinstance(part.findings, Sequence):  # not a user's own
            report.add(f for f in part.findings if isinstance(f, Finding))
    if any(f.source == "preset" and "precision" in f.data for f in report.findings):  # says it with why
        report.findings = [f for f in report.findings if not (f.source == "doctor" and "precision" in f.data)]
    report.tuned = tuned_values(trainer)
    return report


def tuned_values(trainer: L.Trainer) -> dict[str, Any]:
    """The settings the run trains with: loader, precision, strategy, and what boost parts tuned."""
    values: dict[str, Any] = {}
    loader = trainer.train_dataloader
    if isinstance(loader, DataLoader):
        values.update(
            batch_size=loader.batch_size,
            num_workers=loader.num_workers,
            prefetch_factor=loader.prefetch_factor,
            pin_memory=loader.pin_memory,
            persistent_workers=loader.persistent_workers,
        )
    values.update(
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        precision=trainer.precision,
        strategy=type(trainer.strategy).__name__,
        world_size=trainer.world_size,
    )
    for part in [trainer.strategy, datamodule_of(trainer), *callbacks_of(trainer)]:
        if isinstance(part, ReportsTuned) and isinstance(part.tuned, Mapping):  # not a user's own flag
            values.update(part.tuned)
    return values


def log_dir(trainer: L.Trainer) -> Path:
    """This run's own directory under its first logger: `Trainer.log_dir` (without its broadcast,
    so rank zero alone can ask, even after a failure), except that a logger whose `save_dir` is
    shared between runs (MLflow's ``mlruns``, W&B's) gets Lightning's layout,
    ``save_dir/name/version``, so one run's files never overwrite another's."""
    if trainer.loggers:
        logger = trainer.loggers[0]
        if is_lightning(logger, "TensorBoardLogger", "CSVLogger"):
            path = logger.log_dir
        elif logger.save_dir is not None and logger.name and logger.version is not None:
            path = str(Path(logger.save_dir, str(logger.name), str(logger.version)))
        else:
            path = logger.save_dir
        if path is not None:
            return Path(path)
    return Path(trainer.default_root_dir)


def _console(trainer: L.Trainer) -> Any:
    """The live rich progress bar's console when there is one (the table then prints above it)."""
    bar = trainer.progress_bar_callback
    progress = getattr(bar, "progress", None) if is_lightning(bar, "RichProgressBar") else None
    return progress.console if progress is not None else make_console()


def _print(report: Report, path: Path | None, console: Any, repeat: str | None) -> None:
    report.print_to(console)
    if path is not None:
        console.print(f"Report files: {path.parent}/boost_report.{{json,md}}", soft_wrap=True)
    if repeat is not None:
        console.print(repeat, soft_wrap=True)
