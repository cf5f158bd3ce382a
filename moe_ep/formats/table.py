"""Quantization format names and the shape rules each imposes. Pure data: the codecs are moe_ep.formats.codecs,
the weight / activation packs moe_ep.formats.packs.

A format names both the expert weights' and the activations' encoding, as the kernels pair them:
  bf16        no quantization; the FC2 input is handed off in bf16.
  fp8_block   e4m3; activations 1x128 per token (FC2 input 1x64), weights 128x128 blocks; fp32 scales.
  fp8_tensor  e4m3; one fp32 scale per expert weight, static (calibrated) activation scales.
  mxfp8       e4m3 with one e8m0 (power of two) scale per 32 along K, activations and weights.
  nvfp4       e2m1 with one e4m3 scale per 16 along K and an fp32 global scale per tensor.
  w4a8_mxfp4  weights e2m1 + e8m0 scale per 32 along K (at most 11 binades of scales per expert weight tensor);
              activations e4m3 with one fp32 scale per token, the FC2 input 1x64 per (token, topk).
  w4a8_nvfp4  weights e2m1 + e4m3 scale per 16 along K + fp32 global scale per expert (nvfp4's weight codec);
              activations as w4a8_mxfp4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from moe_ep.errors import FormatError

__all__ = ["FORMATS", "FormatInfo", "format_info", "check_format", "format_violations"]


@dataclass(frozen=True)
class FormatInfo:
    name: str
    hidden_multiple: int        # H must be a multiple (K of FC1)
    intermediate_multiple: int  # I must be a multiple (K of FC2, and N blocks of FC1)
    static_activation_scales: bool  # needs ExpertWeights.act_amax / fc2_act_amax
    description: str


_INFO: Dict[str, FormatInfo] = {
    "bf16": FormatInfo("bf16", 1, 1, False, "bf16 weights and activations"),
    # 128x128 weight blocks over N=2I (gate/up interleaved, so a block holds 64 gate + 64 up rows) and K=H;
    # FC2's K (=I) is cut in 128-blocks for weights and 64-blocks for the FC2 input.
    "fp8_block": FormatInfo("fp8_block", 128, 128, False, "e4m3, 1x128 activation / 128x128 weight fp32 scales"),
    "fp8_tensor": FormatInfo("fp8_tensor", 1, 1, True, "e4m3, per-expert weight scale, static activation scales"),
    "mxfp8": FormatInfo("mxfp8", 32, 32, False, "e4m3 + e8m0 scale per 32 along K"),
    "nvfp4": FormatInfo("nvfp4", 16, 16, True, "e2m1 + e4m3 scale per 16 along K + fp32 global scale"),
    # W4A8: 4-bit weights widened to e4m3 inside the kernel, FP8 activations. K of FC1 (H) is cut by the weight
    # scale block; FC2's K (I) by the FC2 input's 64-blocks.
    "w4a8_mxfp4": FormatInfo("w4a8_mxfp4", 32, 64, False,
                             "e2m1 weights + e8m0 scale per 32 along K; e4m3 activations, per-token scale"),
    "w4a8_nvfp4": FormatInfo("w4a8_nvfp4", 16, 64, False,
                             "e2m1 weights + e4m3 scale per 16 along K + fp32 global scale; e4m3 activations, "
                             "per-token scale"),
}

FORMATS: Tuple[str, ...] = tuple(_INFO)


def format_info(fmt: str, argument: str = "fmt") -> FormatInfo:
    check_format(fmt, argument)
    return _INFO[fmt]


def check_format(fmt, argument: str = "fmt") -> str:
    if not isinstance(fmt, str) or fmt not in _INFO:
        raise FormatError(argument, f"expected one of {list(FORMATS)}, got {fmt!r}")
    return fmt


def format_violations(fmt: str, hidden_size: int, intermediate_size: int) -> List[Tuple[str, str]]:
    """(argument, message) for each size the format cannot encode."""
    info = format_info(fmt)
    out = []
    if hidden_size % info.hidden_multiple:
        out.append(("hidden_size", f"must be a multiple of {info.hidden_multiple} for fmt {fmt!r}, "
                                   f"got {hidden_size}"))
    if intermediate_size % info.intermediate_multiple:
        out.append(("intermediate_size", f"must be a multiple of {info.intermediate_multiple} for fmt {fmt!r}, "
                                         f"got {intermediate_size}"))
    return out
