"""Local engines on the grouped GEMMs torch ships, for the split path at large T. Each computes numerics of its own,
named in `numerics` (and so in layer.plan), and is never an `auto` candidate unless asked for by name: a layer in
fp8_block built with one computes what it says, not the format.

  torch_fp8_block128   DeepSeek-V3's own block scaling on torch._scaled_mm, one GEMM per expert: FC1 exactly the
                       format's operands (1x128 activation, 128x128 weight scales); the FC2 input requantized per
                       1x128 block where the format (and its kernels) use 1x64 (cuBLAS scales activations per 128), and
                       the FC1 output handed to SwiGLU in bf16. Rows arrive as the format's FP8 (half the bytes).
                       Not capturable: the per-expert row counts are read on the host.
  torch_fp8_rowwise    torch._scaled_grouped_mm (one grouped GEMM per projection, offsets on the device: capturable):
                       per-token activation scales over the whole row and per-channel weight scales, requantized from
                       the layer's bf16 weights (a quantized pack is refused: moe_ep never requantizes one).

Both sum a row's slot terms in fp32 in slot order and round once, as the fused kernels' top-k reduce does. On a CPU
(no FP8 GEMM there) they run the same steps with fp32 matmuls over the same quantized operands: what the tests check
the plumbing with; the device path swaps the matmuls for torch's.

How the block128 engine lays out its rows (why, from torch's and cuBLAS's rules for blockwise `_scaled_mm`): each
expert's rows sit in a block of its own, padded to ROW_ALIGN rows, and each block's 1x128 activation scales are
column-major over exactly that block ([m, K/128] with strides (1, m): torch checks the stride equals the GEMM's M).
cuBLAS's block-scaled FP8 kernels want every dimension 16-byte aligned, and the scales' leading dimension is M, so M
itself must be a multiple of 4 fp32 words: an expert's bare row count (any number) is refused with
CUBLAS_STATUS_NOT_SUPPORTED. Padding rows read finite bytes (a real row's) and their outputs are never read; a GEMM's
rows are independent, so they change nothing else. tools/bench/scaled_mm_probe.py checks these rules on a device.

The steps around the GEMMs (SwiGLU with the FC2-input quantization, and the slot reduce) run as torch ops here, or as
one Triton kernel each on a CUDA device (shim/sm90/split_kernels.py, named below by lazy string; `kernels=` picks).
The kernels follow the torch ops' roundings one by one (the probe compares their bytes on the device).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import List, Optional

import torch

from moe_ep.core.weights import QuantizedExpertWeights
from moe_ep.errors import BackendUnavailableError, FormatError, SpecError
from moe_ep.formats import packs
from moe_ep.formats.codecs import FP8_ACT_BLOCK_K, FP8_WEIGHT_BLOCK, fp8_block_mm, fp8_quantize_rows
from moe_ep.split.engine import LocalEngine

__all__ = ["ScaledMMEngine", "GroupedRowwiseEngine", "TorchOps", "KERNELS", "ROW_ALIGN", "gate_up_blocks",
           "block_scaled_mm", "resolve_ops", "padded_blocks"]

FC2_BLOCK = FP8_ACT_BLOCK_K  # what torch._scaled_mm's 1x128 activation scaling takes
ROW_ALIGN = 16  # rows per expert block: a multiple of 4 (the scales' leading dimension), 16 for the FP8 operands
GATE_GROUP = 64  # the block128 engine's w13 order: gate 64 rows, up 64 rows, ... (gate_up_blocks)
# Where the non-GEMM steps can run besides torch ops (module path, loaded only when asked for or on "auto").
KERNELS = {"triton": "shim.sm90.split_kernels"}


def gate_up_blocks(intermediate: int, device=None) -> torch.Tensor:
    """Canonical w13 rows (gate [0, I), up [I, 2I)) -> the order whose 128-row blocks match fp8_block's weight
    scale rows: gate 64n..64n+63, then up 64n..64n+63, for each n."""
    n = torch.arange(intermediate // GATE_GROUP, device=device).unsqueeze(1) * GATE_GROUP + torch.arange(
        GATE_GROUP, device=device)
    return torch.stack([n, n + intermediate], dim=1).reshape(-1)


def block_scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    out: torch.Tensor) -> torch.Tensor:
    """out [M, N] bf16 = a [M, K] e4m3 (1x128 scales a_scale [M, K/128]) x w [N, K] e4m3 (128x128 scales w_scale
    [N/128, K/128]). On CUDA a_scale must be column-major over exactly these rows (strides (1, M)) and M a multiple
    of ROW_ALIGN (the module docstring); the CPU computes the same products in fp32 (fp8_block_mm)."""
    if a.is_cuda:
        return torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16, out=out)
    rows = torch.arange(w.shape[0], device=a.device) // FP8_WEIGHT_BLOCK
    return out.copy_(fp8_block_mm(a, a_scale, FP8_ACT_BLOCK_K, w, w_scale, rows))


def padded_blocks(counts: List[int], align: int = ROW_ALIGN):
    """Per-expert row counts -> (starts, padded sizes, total): each expert's block rounded up to `align` rows,
    blocks back to back in expert order."""
    sizes = [-(-m // align) * align for m in counts]
    starts, at = [], 0
    for s in sizes:
        starts.append(at)
        at += s
    return starts, sizes, at


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


class TorchOps:
    """The engines' non-GEMM steps in torch ops: the CPU path, and what the Triton kernels are held to."""

    name = "torch"

    @staticmethod
    def quantize_rows(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
        """bf16 [N, H] -> q_out e4m3 [N, H], s_out fp32 [N]: the format's quantizer with one block per row."""
        q, s = fp8_quantize_rows(x, x.shape[1], reciprocal=False)
        _u8(q_out).copy_(_u8(q))
        s_out.copy_(s.reshape(-1))

    @staticmethod
    def swiglu_quant(fc1: torch.Tensor, gate_group: int, clamp: Optional[float], weight: Optional[torch.Tensor],
                     block: int, q_out: torch.Tensor, s_out: torch.Tensor, s_base: Optional[torch.Tensor] = None,
                     s_step: Optional[torch.Tensor] = None) -> None:
        """fc1 bf16 [M, 2I], gate and up in alternating groups of gate_group columns (gate_group = I: gate | up)
        -> y = up * (gate * sigmoid(gate)) in fp32 (the reference's SwiGLU, its clamp first), times weight [M] when
        given, quantized per 1 x block the FC2-input way (x * (1 / scale)): q_out e4m3 [M, I]; the scale of (row r,
        block b) at s_out.view(-1)[s_base[r] + b * s_step[r]] (row-major [M, I/block] when s_base is None)."""
        m, two_i = fc1.shape
        i = two_i // 2
        v = fc1.view(m, i // gate_group, 2, gate_group)
        gate = v[:, :, 0].reshape(m, i).to(torch.float32)
        up = v[:, :, 1].reshape(m, i).to(torch.float32)
        if clamp is not None:
            limit = abs(float(clamp))
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
        y = up * (gate * torch.sigmoid(gate))
        if weight is not None:
            y = y * weight.to(torch.float32).unsqueeze(1)
        q, s = fp8_quantize_rows(y, block, reciprocal=True)
        q_out.copy_(q)
        if s_base is None:
            s_out.view(-1)[: s.numel()].copy_(s.reshape(-1))
            return
        nb = i // block
        dest = s_base.unsqueeze(1) + torch.arange(nb, device=s.device) * s_step.unsqueeze(1)
        s_out.view(-1).index_copy_(0, dest.reshape(-1), s.reshape(-1))

    @staticmethod
    def combine(terms: torch.Tensor, pos_of: torch.Tensor, width: int, weight: Optional[torch.Tensor],
                out: torch.Tensor) -> None:
        """terms bf16 [P, H]; pos_of int64 [N * width]: the terms row of (row n, slot j) at n * width + j, -1 for a
        slot with none -> out [N, H]: per row the fp32 sum of its slots' terms in slot order, rounded once (a slot
        with no term adds +0.0). weight [N * width] (unweighted FC2): each term is first rounded to bf16 times its
        weight."""
        n, h = out.shape
        if terms.shape[0] == 0:
            out.zero_()
            return
        live = (pos_of >= 0).view(n, width, 1)
        g = terms.index_select(0, pos_of.clamp(min=0)).view(n, width, h)
        if weight is not None:
            g = (g.to(torch.float32) * weight.to(torch.float32).view(n, width, 1)).to(torch.bfloat16)
        g = g.masked_fill(~live, 0)
        if width == 1:
            out.copy_(g[:, 0])
            return
        acc = g[:, 0].to(torch.float32)
        for j in range(1, width):
            acc.add_(g[:, j])
        out.copy_(acc)


def resolve_ops(kernels: str, device: torch.device):
    """(ops, name): the Triton kernels when asked for ("triton": a typed error where they cannot run) or on "auto"
    where they can (a CUDA device and an importable shim), else torch ops."""
    if kernels not in ("auto", "torch", *KERNELS):
        raise SpecError("kernels", f"expected 'auto', 'torch' or one of {sorted(KERNELS)}, got {kernels!r}")
    if kernels == "torch" or (kernels == "auto" and device.type != "cuda"):
        return TorchOps, "torch"
    name = "triton" if kernels == "auto" else kernels
    if device.type != "cuda":
        raise BackendUnavailableError("kernels", f"the {name!r} kernels run on a CUDA device, not {device}")
    try:
        mod = importlib.import_module(KERNELS[name])
        if mod.unavailable_reason() is None:
            return mod, name
        reason = mod.unavailable_reason()
    except ImportError as e:
        reason = f"importing {KERNELS[name]!r} failed: {e}"
    if kernels == "auto":
        return TorchOps, "torch"
    raise BackendUnavailableError("kernels", f"the {name!r} kernels cannot run here: {reason}")


def _pairs(ids: torch.Tensor, experts: int):
    """(pair order by expert, row of each, slot id row*width+slot, counts per expert) of the live slots."""
    n, width = ids.shape
    flat = ids.reshape(-1).to(torch.int64)
    key = torch.where(flat >= 0, flat, experts)
    order = torch.argsort(key, stable=True)
    # scatter_add, not bincount: CUDA's bincount reads its input's max on the host, which a capture cannot hold.
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(
        0, key, torch.ones_like(key))[:experts]
    return order, torch.div(order, width, rounding_mode="floor"), counts


class _TorchEngine(LocalEngine):
    """What both torch engines share: the choice of kernels for the steps around the GEMMs."""

    formats = ("fp8_block",)
    base_numerics = ""

    def __init__(self, spec, ctx, fmt, *, expert_offset: int = 0, apply_topk_in_fc1: bool = True,
                 kernels: str = "auto"):
        super().__init__(spec, ctx, fmt, expert_offset=expert_offset, apply_topk_in_fc1=apply_topk_in_fc1)
        self.ops, self.kernels = resolve_ops(kernels, ctx.device)
        steps = "Triton kernels" if self.kernels == "triton" else "torch ops"
        self.numerics = f"{self.base_numerics}; SwiGLU, FC2-input quantization and slot reduce: {steps}"

    @classmethod
    def check(cls, spec, fmt, device, options):
        super().check(spec, fmt, device, options)
        unknown = sorted(set(options) - {"kernels"})
        if unknown:
            raise SpecError(unknown[0], f"the split path's {cls.name!r} engine takes engine_options kernels=; got "
                                        f"{unknown}")
        resolve_ops(options.get("kernels", "auto"), device)

    def oracle_weights(self):
        return self._qw

    def forward(self, rows, ids, weights, out):
        if ids.shape[0] == 0:
            return out
        call = self.stage(rows, ids, weights)
        if call is None:  # no live slot: every row's partial is zero
            return out.zero_()
        self.fc1(call)
        self.act(call)
        self.fc2(call)
        return self.combine(call, out)


@dataclass
class _BlockCall:
    """One forward of the block128 engine: rows in per-expert blocks of ROW_ALIGN (padded_blocks)."""

    width: int
    starts: List[int]
    sizes: List[int]
    total: int
    pos_of: torch.Tensor        # [N * width]: the padded row of each (row, slot), -1 for none
    slot_w: torch.Tensor        # fp32 [N * width]: the routing weights, slot order
    row_w: torch.Tensor         # fp32 [total]: the routing weight of each padded row (0 on padding)
    s_base: torch.Tensor        # [total]: where a row's first scale goes in a block's column-major scales
    s_step: torch.Tensor        # [total]: its block's row count (the scales' leading dimension)
    a_q: torch.Tensor           # e4m3 [total, H]
    a_s: torch.Tensor           # fp32 [total * H/128]: per-block column-major 1x128 scales
    fc1: torch.Tensor           # bf16 [total, 2I]
    y_q: torch.Tensor           # e4m3 [total, I]
    y_s: torch.Tensor           # fp32 [total * I/128]
    terms: torch.Tensor         # bf16 [total, H]


class ScaledMMEngine(_TorchEngine):
    name = "torch_fp8_block128"
    takes_quantized = True
    capturable = False
    base_numerics = ("fp8_block FC1 operands; the FC2 input scaled per 1x128 (the format: 1x64) and the FC1 output "
                     "rounded to bf16 before SwiGLU (torch._scaled_mm per expert)")

    def prepare_weights(self, weights) -> None:
        dev = self.ctx.device
        if isinstance(weights, QuantizedExpertWeights):
            qw = weights.qw.to(dev)
        else:
            qw = packs.quantize_weights("fp8_block", weights.w13.to(dev), weights.w2.to(dev))
        self._qw = replace(qw, expert_offset=self.expert_offset)
        perm = gate_up_blocks(qw.intermediate_size, dev)
        self._w13 = qw.w13_q.index_select(1, perm).contiguous()  # [E, 2I, H], 128-row blocks = scale rows
        self._s13 = qw.w13_scale.contiguous()
        self._w2, self._s2 = qw.w2_q.contiguous(), qw.w2_scale.contiguous()

    def stage(self, rows, ids, weights) -> Optional[_BlockCall]:
        """Rows into per-expert blocks (the one host read: the blocks' sizes), their scales column-major per
        block, and the index maps the later steps use; None when no slot is live."""
        n, width = ids.shape
        e, h, i = self._w13.shape[0], self._w13.shape[2], self._w2.shape[2]
        dev = rows.q.device
        order, row, counts = _pairs(ids, e)
        counts_h = counts.tolist()  # the host read that keeps this engine out of graphs
        live = sum(counts_h)
        if live == 0:
            return None
        starts, sizes, total = padded_blocks(counts_h)
        order, row = order[:live], row[:live]
        # Padded row of each live pair (sorted by expert): its place among the live pairs, shifted by how far its
        # expert's block starts past the expert's first pair.
        shift, at = [], 0
        for s, m in zip(starts, counts_h):
            shift.append(s - at)
            at += m
        first = torch.tensor(shift, dtype=torch.int64, device=dev)
        key = ids.reshape(-1).to(torch.int64).index_select(0, order)
        pos = torch.arange(live, device=dev) + first.index_select(0, key)
        src = torch.zeros(total, dtype=torch.int64, device=dev).index_copy_(0, pos, row)  # padding reads row 0
        pos_of = torch.full((n * width,), -1, dtype=torch.int64, device=dev).index_copy_(0, order, pos)
        slot_w = weights.reshape(-1).to(torch.float32)
        row_w = torch.zeros(total, dtype=torch.float32, device=dev).index_copy_(0, pos, slot_w.index_select(0, order))
        expert_of = torch.repeat_interleave(torch.arange(e, device=dev), torch.tensor(sizes, device=dev),
                                            output_size=total)
        start_of = torch.tensor(starts, dtype=torch.int64, device=dev).index_select(0, expert_of)
        s_step = torch.tensor(sizes, dtype=torch.int64, device=dev).index_select(0, expert_of)
        s_base = torch.arange(total, device=dev) - start_of  # the row's place in its block...
        a_q = torch.empty((total, h), dtype=torch.float8_e4m3fn, device=dev)
        torch.index_select(_u8(rows.q), 0, src, out=_u8(a_q))
        kb1 = h // FP8_ACT_BLOCK_K
        a_s = torch.empty(total * kb1, dtype=torch.float32, device=dev)
        dest = (start_of * kb1 + s_base).unsqueeze(1) + torch.arange(kb1, device=dev) * s_step.unsqueeze(1)
        a_s.index_copy_(0, dest.reshape(-1), rows.scale.index_select(0, src).reshape(-1))
        kb2 = i // FC2_BLOCK
        return _BlockCall(
            width=width, starts=starts, sizes=sizes, total=total, pos_of=pos_of, slot_w=slot_w, row_w=row_w,
            s_base=start_of * kb2 + s_base, s_step=s_step, a_q=a_q, a_s=a_s,
            fc1=torch.empty((total, 2 * i), dtype=torch.bfloat16, device=dev),
            y_q=torch.empty((total, i), dtype=torch.float8_e4m3fn, device=dev),
            y_s=torch.empty(total * kb2, dtype=torch.float32, device=dev),
            terms=torch.empty((total, h), dtype=torch.bfloat16, device=dev))

    @staticmethod
    def _gemms(c: _BlockCall, a_q, a_s, w, w_s, out) -> None:
        kb = a_q.shape[1] // FP8_ACT_BLOCK_K
        for x, (s, m) in enumerate(zip(c.starts, c.sizes)):
            if m:
                scale = a_s[s * kb:(s + m) * kb].view(kb, m).t()  # [m, K/128], strides (1, m)
                block_scaled_mm(a_q[s:s + m], scale, w[x], w_s[x], out[s:s + m])

    def fc1(self, c: _BlockCall) -> None:
        self._gemms(c, c.a_q, c.a_s, self._w13, self._s13, c.fc1)

    def act(self, c: _BlockCall) -> None:
        self.ops.swiglu_quant(c.fc1, GATE_GROUP, self.spec.gate_up_clamp, c.row_w if self.apply_topk_in_fc1 else None,
                              FC2_BLOCK, c.y_q, c.y_s, c.s_base, c.s_step)

    def fc2(self, c: _BlockCall) -> None:
        self._gemms(c, c.y_q, c.y_s, self._w2, self._s2, c.terms)

    def combine(self, c: _BlockCall, out: torch.Tensor) -> torch.Tensor:
        self.ops.combine(c.terms, c.pos_of, c.width, None if self.apply_topk_in_fc1 else c.slot_w, out)
        return out


def _rowwise(x: torch.Tensor, reciprocal: bool = False):
    """[M, K] -> (e4m3, fp32 [M]): one scale per row, the format's quantizer with one block spanning the row."""
    q, s = fp8_quantize_rows(x, x.shape[1], reciprocal=reciprocal)
    return q, s.reshape(-1)


@dataclass
class _RowwiseCall:
    """One forward of the rowwise engine: every (row, slot) pair in expert order, the -1 slots last."""

    width: int
    offs: torch.Tensor          # int32 [E]: the groups' ends
    counts: torch.Tensor        # int64 [E] (the CPU path's loop)
    pos_of: torch.Tensor        # [N * width]: the pair row of each (row, slot), -1 for a -1 slot
    slot_w: torch.Tensor        # fp32 [N * width]
    pair_w: torch.Tensor        # fp32 [P]: the routing weight of each pair row
    x_q: torch.Tensor           # e4m3 [P, H]
    x_s: torch.Tensor           # fp32 [P]
    fc1: Optional[torch.Tensor] = None
    y_q: Optional[torch.Tensor] = None
    y_s: Optional[torch.Tensor] = None
    terms: Optional[torch.Tensor] = None


class GroupedRowwiseEngine(_TorchEngine):
    name = "torch_fp8_rowwise"
    takes_quantized = False
    capturable = True
    base_numerics = ("FP8 rowwise, not the layer's format: per-token activation scales, per-channel weight scales "
                     "(torch._scaled_grouped_mm)")

    def prepare_weights(self, weights) -> None:
        if isinstance(weights, QuantizedExpertWeights):
            raise FormatError("weights", "the torch_fp8_rowwise engine quantizes bf16 weights per channel; a "
                                         "quantized pack would have to be requantized, which moe_ep never does")
        dev = self.ctx.device
        w13, w2 = weights.w13.to(dev), weights.w2.to(dev)
        e = w13.shape[0]
        q13, s13 = _rowwise(w13.reshape(-1, w13.shape[2]))
        q2, s2 = _rowwise(w2.reshape(-1, w2.shape[2]))
        self._w13, self._s13 = q13.view(w13.shape), s13.view(e, -1)  # [E, 2I, H], [E, 2I]
        self._w2, self._s2 = q2.view(w2.shape), s2.view(e, -1)  # [E, H, I], [E, H]
        # What the oracle sees: the layer's own format over the same bf16 weights (this engine's numerics differ).
        self._qw = packs.quantize_weights("fp8_block", w13, w2, expert_offset=self.expert_offset)

    def _gmm(self, a, a_s, w, w_s, c: _RowwiseCall):
        if a.is_cuda:
            return torch._scaled_grouped_mm(a, w.transpose(1, 2), a_s, w_s, offs=c.offs, out_dtype=torch.bfloat16)
        out = torch.zeros((a.shape[0], w.shape[1]), dtype=torch.float32)
        at = 0
        for x, m in enumerate(c.counts.tolist()):
            if m:
                raw = a[at:at + m].to(torch.float32) @ w[x].to(torch.float32).t()
                out[at:at + m] = raw * a_s[at:at + m].unsqueeze(1) * w_s[x].unsqueeze(0)
            at += m
        return out.to(torch.bfloat16)

    def stage(self, rows, ids, weights) -> _RowwiseCall:
        """Each token quantized once (a row's scale does not depend on the expert it goes to), then its bytes
        gathered per pair; every shape fixed by N and width, nothing read on the host."""
        n, width = ids.shape
        order, row, counts = _pairs(ids, self._w13.shape[0])
        offs = torch.cumsum(counts, 0).to(torch.int32)
        q_tok = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=rows.device)
        s_tok = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        if rows.shape[0]:
            self.ops.quantize_rows(rows, q_tok, s_tok)
        x_q = torch.empty((order.shape[0], q_tok.shape[1]), dtype=torch.float8_e4m3fn, device=rows.device)
        torch.index_select(_u8(q_tok), 0, row, out=_u8(x_q))  # the -1 slots last, past offs[-1]: no group reads them
        p = torch.arange(order.shape[0], device=rows.device)
        # The -1 slots are dropped on the device, so a capture needs no host count.
        pos_of = torch.empty_like(order).index_copy_(0, order, torch.where(p < offs[-1], p, -1))
        slot_w = weights.reshape(-1).to(torch.float32)
        return _RowwiseCall(width=width, offs=offs, counts=counts, pos_of=pos_of, slot_w=slot_w,
                            pair_w=slot_w.index_select(0, order), x_q=x_q, x_s=s_tok.index_select(0, row))

    def fc1(self, c: _RowwiseCall) -> None:
        c.fc1 = self._gmm(c.x_q, c.x_s, self._w13, self._s13, c)

    def act(self, c: _RowwiseCall) -> None:
        p, i = c.fc1.shape[0], self._w2.shape[2]
        c.y_q = torch.empty((p, i), dtype=torch.float8_e4m3fn, device=c.fc1.device)
        c.y_s = torch.empty(p, dtype=torch.float32, device=c.fc1.device)
        self.ops.swiglu_quant(c.fc1, i, self.spec.gate_up_clamp, c.pair_w if self.apply_topk_in_fc1 else None, i,
                              c.y_q, c.y_s)

    def fc2(self, c: _RowwiseCall) -> None:
        c.terms = self._gmm(c.y_q, c.y_s, self._w2, self._s2, c)

    def combine(self, c: _RowwiseCall, out: torch.Tensor) -> torch.Tensor:
        self.ops.combine(c.terms, c.pos_of, c.width, None if self.apply_topk_in_fc1 else c.slot_w, out)
        return out
