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
"""

from __future__ import annotations


import torch

from moe_ep.core.errors import FormatError
from moe_ep.core.weights import QuantizedExpertWeights
from moe_ep.formats import packs
from moe_ep.formats.codecs import FP8_ACT_BLOCK_K, FP8_WEIGHT_BLOCK, fp8_block_mm, fp8_quantize_rows
from moe_ep.reference.ffn import swiglu
from moe_ep.split.engine import LocalEngine

__all__ = ["ScaledMMEngine", "GroupedRowwiseEngine", "gate_up_blocks", "reduce_slots"]

FC2_BLOCK = FP8_ACT_BLOCK_K  # what torch._scaled_mm's 1x128 activation scaling takes


def gate_up_blocks(intermediate: int, device=None) -> torch.Tensor:
    """Canonical w13 rows (gate [0, I), up [I, 2I)) -> the order whose 128-row blocks match fp8_block's weight
    scale rows: gate 64n..64n+63, then up 64n..64n+63, for each n."""
    n = torch.arange(intermediate // 64, device=device).unsqueeze(1) * 64 + torch.arange(64, device=device)
    return torch.stack([n, n + intermediate], dim=1).reshape(-1)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def reduce_slots(terms: torch.Tensor, pair_of: torch.Tensor, rows: int, width: int, out: torch.Tensor):
    """terms [P, H] in pair order, pair_of [P] = row * width + slot (or rows * width: a pair to drop) -> out
    [rows, H]: per row the fp32 sum of its slots' terms in slot order, rounded once (a -1 slot adds nothing)."""
    h = terms.shape[1]
    dense = torch.zeros((rows * width + 1, h), dtype=torch.bfloat16, device=terms.device)
    dense.index_copy_(0, pair_of, terms.to(torch.bfloat16))
    dense = dense[: rows * width].view(rows, width, h)
    if width == 1:
        return out.copy_(dense[:, 0])
    acc = dense[:, 0].to(torch.float32)
    for j in range(1, width):
        acc.add_(dense[:, j])
    return out.copy_(acc)


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


class ScaledMMEngine(LocalEngine):
    name = "torch_fp8_block128"
    formats = ("fp8_block",)
    takes_quantized = True
    capturable = False
    numerics = ("fp8_block FC1 operands; the FC2 input scaled per 1x128 (the format: 1x64) and the FC1 output "
                "rounded to bf16 before SwiGLU (torch._scaled_mm per expert)")

    def prepare_weights(self, weights) -> None:
        dev = self.ctx.device
        if isinstance(weights, QuantizedExpertWeights):
            qw = weights.qw.to(dev)
        else:
            qw = packs.quantize_weights("fp8_block", weights.w13.to(dev), weights.w2.to(dev))
        from dataclasses import replace

        self._qw = replace(qw, expert_offset=self.expert_offset)
        perm = gate_up_blocks(qw.intermediate_size, dev)
        self._w13 = qw.w13_q.index_select(1, perm).contiguous()  # [E, 2I, H], 128-row blocks = scale rows
        self._s13 = qw.w13_scale.contiguous()
        self._w2, self._s2 = qw.w2_q.contiguous(), qw.w2_scale.contiguous()

    def oracle_weights(self):
        return self._qw

    def _mm(self, a, a_scale, w, w_scale, a_block: int) -> torch.Tensor:
        """[M, K] e4m3 (scales [M, K/a_block]) x [N, K] e4m3 (128x128 scales) -> [M, N] bf16."""
        if a.is_cuda:
            return torch._scaled_mm(a, w.t(), scale_a=_col_major(a_scale), scale_b=w_scale.t(),
                                    out_dtype=torch.bfloat16)
        rows = torch.arange(w.shape[0], device=a.device) // FP8_WEIGHT_BLOCK
        return fp8_block_mm(a, a_scale, a_block, w, w_scale, rows).to(torch.bfloat16)

    def forward(self, rows, ids, weights, out):
        n, width = ids.shape
        if n == 0:
            return out
        e, i = self._w13.shape[0], self._w2.shape[2]
        order, row, counts = _pairs(ids, e)
        live = int(counts.sum())
        order, row = order[:live], row[:live]
        a_q, a_s = rows.q.index_select(0, row), rows.scale.index_select(0, row)
        fc1 = torch.empty((live, 2 * i), dtype=torch.bfloat16, device=out.device)
        at = 0
        spans = []
        for x, m in enumerate(counts.tolist()):  # the host read that keeps this engine out of graphs
            if m:
                fc1[at:at + m] = self._mm(a_q[at:at + m], a_s[at:at + m], self._w13[x], self._s13[x], FP8_ACT_BLOCK_K)
                spans.append((x, at, m))
            at += m
        blocks = fc1.to(torch.float32).view(live, i // 64, 2, 64)
        y = swiglu(torch.cat([blocks[:, :, 0].reshape(live, i), blocks[:, :, 1].reshape(live, i)], dim=1),
                   self.spec.gate_up_clamp)
        w = weights.reshape(-1).index_select(0, order).to(torch.float32).unsqueeze(1)
        if self.apply_topk_in_fc1:
            y = y * w
        q2, s2 = fp8_quantize_rows(y, FC2_BLOCK, reciprocal=True)
        terms = torch.empty((live, self._w2.shape[1]), dtype=torch.bfloat16, device=out.device)
        for x, a, m in spans:
            terms[a:a + m] = self._mm(q2[a:a + m], s2[a:a + m], self._w2[x], self._s2[x], FC2_BLOCK)
        if not self.apply_topk_in_fc1:
            terms = (terms.to(torch.float32) * w).to(torch.bfloat16)
        return reduce_slots(terms, order, n, width, out)


def _rowwise(x: torch.Tensor):
    """[M, K] -> (e4m3, fp32 [M]): one scale per row, the format's quantizer with one block spanning the row."""
    q, s = fp8_quantize_rows(x, x.shape[1], reciprocal=False)
    return q, s.reshape(-1)


class GroupedRowwiseEngine(LocalEngine):
    name = "torch_fp8_rowwise"
    formats = ("fp8_block",)
    takes_quantized = False
    capturable = True
    numerics = ("FP8 rowwise, not the layer's format: per-token activation scales, per-channel weight scales "
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

    def oracle_weights(self):
        return self._qw

    def _gmm(self, a, a_s, w, w_s, offs, counts):
        if a.is_cuda:
            return torch._scaled_grouped_mm(a, w.transpose(1, 2), a_s, w_s, offs=offs, out_dtype=torch.bfloat16)
        out = torch.zeros((a.shape[0], w.shape[1]), dtype=torch.float32)
        at = 0
        for x, m in enumerate(counts.tolist()):
            if m:
                raw = a[at:at + m].to(torch.float32) @ w[x].to(torch.float32).t()
                out[at:at + m] = raw * a_s[at:at + m].unsqueeze(1) * w_s[x].unsqueeze(0)
            at += m
        return out.to(torch.bfloat16)

    def forward(self, rows, ids, weights, out):
        n, width = ids.shape
        if n == 0:
            return out
        order, row, counts = _pairs(ids, self._w13.shape[0])
        offs = torch.cumsum(counts, 0).to(torch.int32)
        x = rows.index_select(0, row)  # every slot, the -1 ones last (past offs[-1]: no group reads them)
        xq, xs = _rowwise(x)
        fc1 = self._gmm(xq, xs, self._w13, self._s13, offs, counts)
        y = swiglu(fc1.to(torch.float32), self.spec.gate_up_clamp)
        w = weights.reshape(-1).index_select(0, order).to(torch.float32).unsqueeze(1)
        if self.apply_topk_in_fc1:
            y = y * w
        yq, ys = _rowwise(y)
        terms = self._gmm(yq, ys, self._w2, self._s2, offs, counts)
        if not self.apply_topk_in_fc1:
            terms = (terms.to(torch.float32) * w).to(torch.bfloat16)
        # The -1 slots (past offs[-1]) are dropped on the device, so a capture needs no host count.
        live = torch.arange(order.shape[0], device=out.device) < offs[-1]
        return reduce_slots(terms, torch.where(live, order, n * width), n, width, out)
