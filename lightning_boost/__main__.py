"""``python -m lightning_boost`` runs the ``lightning-boost`` command."""

import sys

from lightning_boost.cli import main

sys.exit(main())
