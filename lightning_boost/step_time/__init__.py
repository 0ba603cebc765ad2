"""Data wait vs compute per step: `timing` (pure) and `callback` (`StepTimeMonitor`).

Nothing is imported here, so importing a pure module does not import Lightning.
"""
