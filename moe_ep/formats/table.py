"""The format table: every quantization format moe_ep knows, one module each (moe_ep/formats/<name>.py says what
its bytes are and how the kernels that run it compute). Adding a format is a module and a line here.

  bf16        no quantization; the FC2 input is handed off in bf16.
  fp8_block   e4m3; activations 1x128 per token (FC2 input 1x64), weights 128x128 blocks; fp32 scales.
  fp8_tensor  e4m3; one fp32 scale per expert weight, static (calibrated) activation scales.
  mxfp8       e4m3 with one e8m0 (power of two) scale per 32 along K, activations and weights.
  nvfp4       e2m1 with one e4m3 scale per 16 along K and an fp32 global scale per tensor.
  w4a8_mxfp4  weights e2m1 + e8m0 scale per 32 along K; activations e4m3 with one fp32 scale per token.
  w4a8_nvfp4  weights as nvfp4's; activations as w4a8_mxfp4's.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from moe_ep.errors import FormatError
from moe_ep.formats.base import Format
from moe_ep.formats.bf16 import Bf16
from moe_ep.formats.fp8_block import Fp8Block
from moe_ep.formats.fp8_tensor import Fp8Tensor
from moe_ep.formats.mxfp8 import Mxfp8
from moe_ep.formats.nvfp4 import Nvfp4
from moe_ep.formats.w4a8_mxfp4 import W4A8Mxfp4
from moe_ep.formats.w4a8_nvfp4 import W4A8Nvfp4

__all__ = ["FORMATS", "format_info", "check_format", "format_violations"]

_TABLE: Dict[str, Format] = {info.name: info for info in (
    Bf16(), Fp8Block(), Fp8Tensor(), Mxfp8(), Nvfp4(), W4A8Mxfp4(), W4A8Nvfp4(),
)}

FORMATS: Tuple[str, ...] = tuple(_TABLE)


def check_format(fmt, argument: str = "fmt") -> str:
    if not isinstance(fmt, str) or fmt not in _TABLE:
        raise FormatError(argument, f"expected one of {list(FORMATS)}, got {fmt!r}")
    return fmt


def format_info(fmt: str, argument: str = "fmt") -> Format:
    """The format object of `fmt` (FormatError naming `argument` for an unknown one)."""
    check_format(fmt, argument)
    return _TABLE[fmt]


def format_violations(fmt: str, hidden_size: int, intermediate_size: int) -> List[Tuple[str, str]]:
    """(argument, message) for each size the format cannot encode."""
    return format_info(fmt).violations(hidden_size, intermediate_size)
