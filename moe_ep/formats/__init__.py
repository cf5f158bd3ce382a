"""The quantization-format contract: one module per format (bf16, fp8_block, fp8_tensor, mxfp8, nvfp4, w4a8_mxfp4,
w4a8_nvfp4; each a `base.Format`), the table that lists them (table), the element and block codecs they are built of
(codecs), and the weight / activation packs with the quantizers that look a format up (packs). Builds on
moe_ep.errors alone: the shim (staging, weight packing), core and the reference (oracle) all build on it."""

from moe_ep.formats.base import Format
from moe_ep.formats.packs import (QuantizedActivation, QuantizedWeights, check_pack, dequantize_input,
                                  dequantize_weights, pack_rules, quantize_input, quantize_weights)
from moe_ep.formats.table import FORMATS, check_format, format_info, format_violations

__all__ = ["FORMATS", "Format", "format_info", "check_format", "format_violations", "QuantizedWeights",
           "QuantizedActivation", "quantize_weights", "dequantize_weights", "quantize_input", "dequantize_input",
           "pack_rules", "check_pack"]
