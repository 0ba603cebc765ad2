"""The batch size by measurement.

- `search` (pure): the next size to measure, the choice, accumulation and learning-rate factors;
- `decision` (pure): `BatchSizeDecision`, what was decided, and the findings that explain it;
- `callback` (Lightning): `AutoBatchSize`.

Nothing is imported here, so importing a pure module does not import Lightning.
"""
