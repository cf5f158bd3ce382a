"""What geometry each Hopper kernel can serve, stated without importing the kernel tree.

moe_ep asks these before it allocates anything (Backend.check_spec), so this module is plain Python: it
imports neither cutlass nor the drop, and does not activate the sm90 tree. It is the one statement of the
rules (as data: shim.common.backend.size_violations applies them, alike for every tree); the frontends trust
the layer's validation and do not re-check.

Sources of each rule (drop 0.7.4):
  * FP8 blockwise: H and I multiples of 128 -- the 1x128 activation and 128x128 weight scale blocks
    (common/megamoe_constants.py Fp8BlockScaleK, Fp8WeightScaleBlockN/K); FC1's N = 2I is cut in
    128-row blocks over the 8-row gate/up interleave, 64 gate + 64 up rows each.
  * BF16: H and I multiples of 64 -- the BF16 kernel's K tile (every tile in its KNOB_SPACE has K = 64).
  * top_k <= 32: dispatch assigns `32 // num_topk` tokens per warp pass (src/token_comm.py), shared by
    every kernel of the tree.
"""

from __future__ import annotations

from typing import Dict, Tuple

__all__ = ["FORMATS", "FORMAT_MULTIPLE", "MAX_TOP_K"]

FORMATS = ("fp8_block", "bf16")

# (hidden multiple, intermediate multiple) per format.
FORMAT_MULTIPLE: Dict[str, Tuple[int, int]] = {"fp8_block": (128, 128), "bf16": (64, 64)}
MAX_TOP_K = 32

