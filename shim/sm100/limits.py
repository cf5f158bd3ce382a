"""What geometry each Blackwell kernel can serve, stated without importing the kernel tree.

moe_ep asks these before it allocates anything (Backend.check_spec), so this module
is plain Python: it imports neither cutlass nor the drop, and does not activate the
sm100 tree. The rules are data here; shim.common.backend.size_violations applies them,
alike for every tree. The frontends re-check the drop's own constants at kernel build.

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

from typing import Dict, Tuple

__all__ = ["FORMATS", "FORMAT_MULTIPLE", "MAX_TOP_K"]

FORMATS = ("nvfp4", "mxfp8", "bf16")

# (hidden multiple, intermediate multiple) per format.
FORMAT_MULTIPLE: Dict[str, Tuple[int, int]] = {"nvfp4": (64, 64), "mxfp8": (128, 64), "bf16": (32, 32)}
MAX_TOP_K = 32

