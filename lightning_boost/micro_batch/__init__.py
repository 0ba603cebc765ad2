"""Out-of-memory steps retried as micro-batches.

- `split` (pure): a batch's length, its slices, and the step outputs and logged values of the
  slices combined into the batch's;
- `rounds` (pure): one step run as micro-batches in lock-step rounds (every rank together), the
  halving on out-of-memory, the allocator-pressure check;
- `callback` (Lightning): `AutoMicroBatch`.

Nothing is imported here, so importing a pure module does not import Lightning.
"""
