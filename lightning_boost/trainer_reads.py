"""The run's trainer as a copy of the model reads it (`lightning_boost._lightning.detached_copy`).

The pack's trials and probes step a copy of the model outside the fit. A step that reads the fit
(``self.lr_schedulers().get_last_lr()`` logged each step, a KL weight ramped over
``self.trainer.max_epochs``, ``self.trainer.datamodule``) raised there, since a copy has no trainer,
and the tuning stopped. `TrainerReads` gives the copy the run's trainer to read: a value the copy's
step sets on it stays the copy's (an object reached through it, the datamodule say, is the run's
own), its loggers are none (``self.logger`` is ``None``, as without a trainer), and with several
processes its strategy is refused, since each rank runs as many copy steps as its own clock says
and a collective would wait on ranks that run none. The copy's optimizers and schedulers are its
own (`lightning_boost._lightning.answer_optimizers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning as L


class TrainerReads:
    """`trainer`'s attributes, read through; an attribute set on the view stays on it.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(max_epochs=3, logger=False, enable_progress_bar=False)
        >>> view = TrainerReads(trainer)
        >>> view.max_epochs, view.logger, view.loggers
        (3, None, [])
        >>> view.should_stop = True
        >>> view.should_stop, trainer.should_stop
        (True, False)
        >>> import copy
        >>> copy.deepcopy(view) is view  # a copy of a copy of the model reads the same run
        True
    """

    def __init__(self, trainer: L.Trainer) -> None:
        self._run = trainer

    def __getattr__(self, name: str) -> Any:  # only for what the view does not hold itself
        if name == "_run":  # a view being copied, before its `__init__`
            raise AttributeError(name)
        return getattr(self._run, name)

    def __deepcopy__(self, memo: dict[int, Any]) -> TrainerReads:  # a copy of a copy reads the same run
        return self

    @property
    def logger(self) -> None:
        return None

    @property
    def loggers(self) -> list[Any]:
        return []

    @property
    def strategy(self) -> Any:
        if self._run.world_size > 1:
            raise RuntimeError(
                "A copy of the model cannot use the strategy of a run on several processes: its"
                " steps, as many on each rank as that rank's clock says, would wait on collectives"
                " (`self.all_gather`) the other ranks do not run."
            )
        return self._run.strategy
