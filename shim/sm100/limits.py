"""What geometry each Blackwell kernel can serve, stated without importing the kernel tree.

moe_ep asks these before it allocates anything (Backend.check_spec), so this module
is plain Python: it imports neither cutlass nor the drop, and does not activate the
sm100 tree. The frontends re-check the drop's own constants at kernel build.

Sources of each rule (drop 0.7.4 unless noted):
  * top_k <= 32: dispatch assigns `32 // num_topk` tokens per warp pass
    (src/token_comm.py); the BF16 kernel checks it explicitly, the others share
    the same dispatch code.
  * BF16: gate+up (2I) a multiple of 64 and H a multiple of 32 -- the BF16 kernel's
    own constructor checks (the fc1 store pairs 32 gate with 32 up columns; fc2
    stores 32-wide hidden subtiles).
  * NVFP4 / MXFP8: H and I multiples of 64. Each format's block (16 / 32) and the
    16-byte TMA row rule need less; 64 is the bound FlashInfer's integration of this
    same drop validates (hidden = inter = 2880 measured on GB200, drop 0.7.2.post1),
    and nothing weaker has been run on hardware, so it is the rule until a Blackwell
    run says otherwise.
  * MXFP8 from 0.7.4: H a multiple of 128. Every launch ends with the column
    re-quantization of the received activations (moe_mxfp8_glu/mxfp8_col_requant.py),
    whose tile spans whole 128-column scale atoms; on sm_100 it takes its portable path
    (4 columns a lane, 32 lanes), so H must be a multiple of lcm(128, 128) = 128, which
    its constructor enforces ("hidden=... is not supported").
"""

from __future__ import annotations

from typing import Dict, List, Tuple

__all__ = ["FORMATS", "FORMAT_MULTIPLE", "MAX_TOP_K", "size_violations"]

FORMATS = ("nvfp4", "mxfp8", "bf16")

# (hidden multiple, intermediate multiple) per format.
FORMAT_MULTIPLE: Dict[str, Tuple[int, int]] = {"nvfp4": (64, 64), "mxfp8": (128, 64), "bf16": (32, 32)}
MAX_TOP_K = 32


def size_violations(fmt: str, *, hidden: int, intermediate: int, top_k: int) -> List[Tuple[str, str]]:
    """(argument, message) for each size the `fmt` kernel cannot serve; empty when it can.

    `intermediate` is moe_ep's I (the down projection's K); the kernels' FC1 width is 2I.
    """
    if fmt not in FORMAT_MULTIPLE:
        return [("fmt", f"the sm100 kernels serve {list(FORMATS)}, got {fmt!r}")]
    h_mult, i_mult = FORMAT_MULTIPLE[fmt]
    out = []
    if hidden % h_mult:
        out.append(("hidden_size", f"must be a multiple of {h_mult} for the sm100 {fmt} kernel, got {hidden}"))
    if intermediate % i_mult:
        out.append(("intermediate_size",
                    f"must be a multiple of {i_mult} for the sm100 {fmt} kernel, got {intermediate}"))
    if not 1 <= top_k <= MAX_TOP_K:
        out.append(("top_k", f"must be in [1, {MAX_TOP_K}] for the sm100 kernels' dispatch, got {top_k}"))
    return out
