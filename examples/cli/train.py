"""LightningCLI with lightning-boost switched on from a YAML file: no code change to the training script.

    python examples/cli/train.py fit --config examples/cli/config.yaml
    python examples/cli/train.py fit --config examples/cli/config.yaml --trainer.max_epochs 3

The preset (``lightning_boost.Preset``, which builds ``preset("auto")``), the callbacks (the
guards, the step-time monitor, the report) and the `BoostedDataModule`'s settings live in
``config.yaml``; every argument can be overridden on the command line, and
``fit --print_config`` shows the whole resolved configuration.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.cli import LightningCLI

from lightning_boost.demo import FakeCIFAR, SmallCNN


def main(args: Sequence[str] | None = None) -> None:
    LightningCLI(SmallCNN, FakeCIFAR, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
