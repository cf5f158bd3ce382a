"""The quantization-format contract: the format table (table), the element and block codecs (codecs), and the
weight / activation packs with their quantizers (packs). A leaf package: it imports only moe_ep.errors,
and both the shim (staging, weight packing) and the reference (oracle) build on it."""

from moe_ep.formats.packs import (QuantizedActivation, QuantizedWeights, dequantize_input, dequantize_weights,
                                  quantize_input, quantize_weights)
from moe_ep.formats.table import FORMATS, FormatInfo, check_format, format_info, format_violations

__all__ = ["FORMATS", "FormatInfo", "format_info", "check_format", "format_violations", "QuantizedWeights",
           "QuantizedActivation", "quantize_weights", "dequantize_weights", "quantize_input", "dequantize_input"]
