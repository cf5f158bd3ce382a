"""What a quantization format is: one object that knows its size rules, the fields of its pack, how its bytes are
made and read, and how the kernels that run it compute (the reference FFN's quirks). Each format is one module of
this package (moe_ep/formats/<name>.py) holding one `Format` subclass; the table (table.py) lists them.

A format names both the expert weights' and the activations' encoding, as the kernels pair them. Its hooks take
and return plain tensors (and read a pack's fields by name), so this module and the format modules build on the
codecs alone; the pack types (packs.py) sit above the table and wrap what the hooks return.

Pack fields (E experts held, H hidden, I intermediate; every format carries w13_q [E, 2I, H] and w2_q [E, H, I]):
  w13_scale, w2_scale               block or per-expert weight scales
  w13_global_scale, w2_global_scale per-expert fp32 global scales (NVFP4 weight codec)
  act_scale, fc2_act_scale          static FC1-input / FC2-input activation scales (statically scaled formats)
"""

from __future__ import annotations

from typing import ClassVar, Dict, List, Optional, Tuple

import torch

from moe_ep.errors import ShapeError
from moe_ep.formats import codecs

__all__ = ["Format", "W4A8Format", "FIELDS", "PER_EXPERT_FIELDS", "POSITIVE_FIELDS", "Rule", "check_e2m1_codes",
           "nvfp4_weight_fields", "nvfp4_weight_rules", "nvfp4_dequantize_weights"]

# Every field a pack may carry beyond w13_q / w2_q, in pack order.
FIELDS = ("w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale", "act_scale", "fc2_act_scale")
# Fields indexed by expert (dim 0) in every format; a format adds its own per-expert activation scales.
PER_EXPERT_FIELDS = ("w13_q", "w2_q", "w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale")
# fp32 fields that are multipliers or divisors: a zero, negative, NaN or inf one is never a checkpoint's intent.
POSITIVE_FIELDS = ("w13_global_scale", "w2_global_scale", "act_scale", "fc2_act_scale")

Rule = Tuple[torch.dtype, Tuple[int, ...]]
F32, E4M3, U8 = torch.float32, torch.float8_e4m3fn, torch.uint8
E8M0 = getattr(torch, "float8_e8m0fnu", None)


class Format:
    """One quantization format. Subclasses set the class attributes and fill in the hooks; one instance each,
    listed in moe_ep/formats/table.py."""

    name: ClassVar[str]
    description: ClassVar[str]
    hidden_multiple: ClassVar[int] = 1  # H must be a multiple (K of FC1)
    intermediate_multiple: ClassVar[int] = 1  # I must be a multiple (K of FC2, and N blocks of FC1)
    static_activation_scales: ClassVar[bool] = False  # needs ExpertWeights.act_amax / fc2_act_amax
    quantized: ClassVar[bool] = True  # False: the pack holds the weights' own values (bf16)
    per_expert_scales: ClassVar[Tuple[str, ...]] = ()  # activation scales held per expert (beyond PER_EXPERT_FIELDS)
    # Largest per-token relative L2 error of a backend's output against the oracle (what is left once the oracle
    # repeats the kernels' quantization steps: fp32 accumulation order, the bf16 output rounding, the odd FC2-input
    # element on the other side of a rounding boundary), and of dequant(reported weights) against the canonical
    # bf16 weights (the format's own quantization error, with headroom).
    output_tolerance: ClassVar[float]
    weight_tolerance: ClassVar[float]

    def __repr__(self) -> str:
        return f"<moe_ep format {self.name}>"

    # -- size rules ------------------------------------------------------------------------------------------------
    def violations(self, hidden_size: int, intermediate_size: int) -> List[Tuple[str, str]]:
        """(argument, message) for each size the format cannot encode."""
        out = []
        if hidden_size % self.hidden_multiple:
            out.append(("hidden_size", f"must be a multiple of {self.hidden_multiple} for fmt {self.name!r}, "
                                       f"got {hidden_size}"))
        if intermediate_size % self.intermediate_multiple:
            out.append(("intermediate_size", f"must be a multiple of {self.intermediate_multiple} for fmt "
                                             f"{self.name!r}, got {intermediate_size}"))
        return out

    # -- the pack ----------------------------------------------------------------------------------------------------
    def fields(self, e: int, h: int, i: int) -> Dict[str, Rule]:
        """Field -> (dtype, shape) of every tensor a pack of e experts carries (w13_q and w2_q included)."""
        raise NotImplementedError

    def pack_rules(self, e: int, h: int, i: int) -> Dict[str, Optional[Rule]]:
        """fields(), with None for every field the pack must not carry."""
        return {**dict.fromkeys(FIELDS), **self.fields(e, h, i)}

    def check_values(self, qw, prefix: str) -> None:
        """Value checks beyond dtypes and shapes (a code range, a scale window); ShapeError naming the field."""

    # -- bytes -----------------------------------------------------------------------------------------------------
    def quantize_weights(self, w13: torch.Tensor, w2: torch.Tensor, act_amax: Optional[float],
                         fc2_act_amax: Optional[float]) -> Dict[str, torch.Tensor]:
        """Canonical bf16 [E, 2I, H] / [E, H, I] -> the pack's fields (calibration checked by the caller)."""
        raise NotImplementedError

    def dequantize_weights(self, qw) -> Tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in fp32, canonical layout."""
        raise NotImplementedError

    def quantize_input(self, qw, hidden: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The FC1 input a kernel stages from bf16 hidden [T, H]: (q, per-row scales or None)."""
        raise NotImplementedError

    def dequantize_input(self, qw, act) -> torch.Tensor:
        """A staged FC1 input (moe_ep.formats.QuantizedActivation) -> fp32."""
        raise NotImplementedError

    # -- the reference FFN (moe_ep/reference/ffn.py): the kernels' accumulation and rounding order ------------------
    def fc1(self, qw, e: int, act) -> torch.Tensor:
        """Expert e's FC1 over M staged rows (a QuantizedActivation) -> fp32 [M, 2I] (gate | up)."""
        raise NotImplementedError

    def fc2(self, qw, e: int, y: torch.Tensor) -> torch.Tensor:
        """Expert e's FC2-input quantization and FC2 over the SwiGLU output y fp32 [M, I] -> fp32 [M, H]."""
        raise NotImplementedError

    def kernel_row_tolerance(self, intermediate_size: int) -> float:
        """The per-token bound a kernel's output is held to against the oracle (moe_ep.reference.oracle)."""
        return self.output_tolerance


def check_e2m1_codes(qw, prefix: str) -> None:
    """e2m1 codes are one per byte (0..15), checked an expert at a time (no pack-sized temporary)."""
    for name in ("w13_q", "w2_q"):
        for x, codes in enumerate(getattr(qw, name)):
            if bool((codes > 15).any()):
                raise ShapeError(f"{prefix}.{name}", f"{qw.fmt} codes are e2m1, one per byte (0..15); expert {x} "
                                                     "has a larger byte")


def nvfp4_weight_fields(w13: torch.Tensor, w2: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The NVFP4 weight codec's fields (codes, e4m3 scales per 16, a global scale per expert), which nvfp4 and
    w4a8_nvfp4 share."""
    (q13, s13, g13), (q2, s2, g2) = codecs.nvfp4_quantize_experts(w13), codecs.nvfp4_quantize_experts(w2)
    return dict(w13_q=q13, w2_q=q2, w13_scale=s13, w2_scale=s2, w13_global_scale=g13, w2_global_scale=g2)


def nvfp4_weight_rules(e: int, h: int, i: int) -> Dict[str, Rule]:
    return dict(w13_q=(U8, (e, 2 * i, h)), w2_q=(U8, (e, h, i)), w13_scale=(E4M3, (e, 2 * i, h // 16)),
                w2_scale=(E4M3, (e, h, i // 16)), w13_global_scale=(F32, (e,)), w2_global_scale=(F32, (e,)))


def nvfp4_dequantize_weights(qw) -> Tuple[torch.Tensor, torch.Tensor]:
    return (codecs.nvfp4_dequantize(qw.w13_q, qw.w13_scale, qw.w13_global_scale.reshape(-1, 1, 1)),
            codecs.nvfp4_dequantize(qw.w2_q, qw.w2_scale, qw.w2_global_scale.reshape(-1, 1, 1)))


class W4A8Format(Format):
    """4-bit weights widened to e4m3 inside the SM90 mixed-input kernels, FP8 activations: what the W4A8 formats
    share. The FC1 input has one fp32 scale per token (staged by the host), the FC2 input one per 64 per (token,
    topk), computed by the kernel; K of FC2 (I) is cut by those 64-blocks. A format names its weight codec and
    `operand`: one expert's weight as the kernel multiplies it."""

    intermediate_multiple = 64
    output_tolerance = 3e-2

    def operand(self, qw, leg: str, e: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(e4m3-valued fp32 operand [N, K], fp32 residual) of expert e's `leg` ("w13" / "w2")."""
        raise NotImplementedError

    def quantize_input(self, qw, hidden):
        # One block spanning the row: the kernels' per-token FC1 input scale.
        return codecs.fp8_quantize_rows(hidden, hidden.shape[1], reciprocal=False)

    def dequantize_input(self, qw, act):
        return act.q.to(torch.float32) * act.scale.to(torch.float32)

    def fc1(self, qw, e, act):
        # Full-K raw sum of e4m3 products, times the token's scale (mainloop), times the residual (epilogue).
        operand, residual = self.operand(qw, "w13", e)
        return (act.q.to(torch.float32) @ operand.t()) * act.scale.to(torch.float32) * residual

    def fc2(self, qw, e, y):
        # FC2 input 1x64 per row (tiny-amax branch included); each 64-wide K slice's raw sum promoted by its scale
        # in K order (the mainloop), then the residual (epilogue).
        block = codecs.FP8_FC2_ACT_BLOCK_K
        q, s = codecs.fp8_quantize_rows(y, block, reciprocal=True, tiny_safe=True)
        operand, residual = self.operand(qw, "w2", e)
        n, k = operand.shape
        ones = torch.ones((1, k // block), dtype=torch.float32, device=y.device)
        rows = torch.zeros(n, dtype=torch.int64, device=y.device)
        return codecs.fp8_block_mm(q, s, block, operand, ones, rows, block) * residual
