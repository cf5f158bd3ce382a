"""What the Hopper weight layouts share; each format's own layout is its frontend module's (shim/sm90/
{fp8,fp8_tensor,bf16}_frontend.py; W4A8: shim/sm90/w4a8_weights.py), all K-major (shim/common/weights.py). Facts
from the drop's runners and kernels:

  * FC1 rows gate/up interleaved in groups of `Fp8GateUpInterleave` (8; the BF16 and W4A8 kernels pair them the same
    way): g0..g7, u0..u7, g8..g15, ...;
  * the FP8 kernel's eight weight arguments (`fp8_weight_args`): e4m3 FC1 / FC2, their scale-factor slots and the
    per-tensor dequant scales (activation (1,), weight (E,)), the same for both scale modes.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from moe_ep.formats import codecs
from shim.common.weights import round_up

__all__ = ["GATE_UP_INTERLEAVE", "e8m0_placeholder", "fp8_weight_args"]

GATE_UP_INTERLEAVE = codecs.FP8_GATE_UP_INTERLEAVE  # checked against the drop's constant at kernel build


def e8m0_placeholder(experts: int, n: int, k: int, device) -> torch.Tensor:
    """e8m0 ones of the runner's swizzled scale shape (E, round_up(N, 128) * round_up(K/32, 4)): what the per-tensor
    program is handed in the blockwise scale slots, which it does not read (megamoe_kernel_fp8.py: "(E, flat_sf)
    padded/swizzled E8M0 placeholder, unused")."""
    flat = round_up(n, 128) * round_up((k + 31) // 32, 4)
    return torch.full((experts, flat), 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)


def fp8_weight_args(b, w) -> Dict[str, Any]:
    """The FP8 kernel's weight arguments from a layout holding fc1/fc2, their scale slots and dequant scales."""
    return dict(
        fc1_weight=b.tensor(w.fc1), fc1_weight_sf=b.tensor(w.fc1_scale),
        fc1_activation_dequant_scale=b.tensor(w.fc1_act_dequant, 4),
        fc1_weight_dequant_scale=b.tensor(w.fc1_w_dequant, 4),
        fc2_weight=b.tensor(w.fc2), fc2_weight_sf=b.tensor(w.fc2_scale),
        fc2_activation_dequant_scale=b.tensor(w.fc2_act_dequant, 4),
        fc2_weight_dequant_scale=b.tensor(w.fc2_w_dequant, 4),
    )
