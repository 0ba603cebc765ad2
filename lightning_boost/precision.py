"""Which precision fits the hardware: a pure function of `HardwareInfo`."""

from __future__ import annotations

from lightning_boost._validation import validated
from lightning_boost.hardware import HardwareInfo


@validated
def auto_precision(hardware: HardwareInfo) -> str:
    """The Lightning ``precision`` an expert would pick for this hardware.

    - CUDA with bf16 (capability >= 8.0: A100, H100, RTX 30xx and newer): ``"bf16-mixed"``,
      same range as fp32 so no loss scaling is needed and no fp16 overflow NaNs.
    - Older CUDA (T4, V100): ``"16-mixed"``, with Lightning's gradient scaler.
    - CPU and MPS: ``"32-true"``; CPU autocast is rarely faster for training.

    Example:
        >>> from lightning_boost.hardware import EXAMPLES
        >>> [auto_precision(EXAMPLES[n]) for n in ("h100", "t4", "cpu")]
        ['bf16-mixed', '16-mixed', '32-true']
    """
    if not hardware.is_cuda:
        return "32-true"
    return "bf16-mixed" if hardware.supports_bf16 else "16-mixed"
