"""Worker settings by measurement.

- `search` (pure): the search over worker counts and prefetch factors, `WorkerTuning`, `WorkerChoice`;
- `decision` (pure): the findings that explain a `WorkerChoice`;
- `loaders` (pure): the timed trials of a loader setting, and which loaders can be rebuilt;
- `model_rates`: the model's step timed per thread count, for a CPU run's split (with the
  step probe both tuners use, `lightning_boost.step_probe`);
- `tuner` (Lightning): `LoaderTuner`, which runs the search for a Trainer and explains the choice;
- `callback` (Lightning): `AutoNumWorkers`.

Nothing is imported here, so importing a pure module does not import Lightning.
"""
