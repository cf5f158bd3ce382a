"""The backend contract. One Backend instance per MoELayer; the layer validates every input first, so
forward() may assume well-formed, in-range, contiguous tensors on ctx.device."""

from __future__ import annotations

from typing import ClassVar, Dict, List, Optional, Tuple

import torch

from moe_ep.core.dist import RankContext
from moe_ep.core.spec import MoESpec
from moe_ep.core.weights import ExpertWeights
from moe_ep.formats import FORMATS, QuantizedWeights, format_violations

__all__ = ["Backend"]


class Backend:
    """Subclass and register (moe_ep.register_backend). Class attributes state what it serves, and the layer takes
    them as stated (the registry resolves only Backend subclasses, and checks once that the class serves every
    format its registration names):

    name, arch ("cpu" | "sm90" | "sm100"), weight_formats (the fmt strings it accepts; the first is its
    default), input_dtypes / routing_weight_dtypes (the hidden / topk_weights dtypes forward() takes as they are,
    rounding hidden to bf16 and reading the weights as fp32 where it stages them; the layer converts any other dtype
    it accepts before the call), allocates_output, needs_p2p. Outputs are bf16 [T, H]. check_spec() states its
    capacity / divisibility rules so the layer can reject a spec before any workspace is allocated. Backend options
    (MoELayer(..., **options)) are the subclass's own constructor keywords.
    """

    name: ClassVar[str] = "abstract"
    arch: ClassVar[str] = "cpu"
    weight_formats: ClassVar[Tuple[str, ...]] = FORMATS
    input_dtypes: ClassVar[Tuple[torch.dtype, ...]] = (torch.bfloat16,)
    routing_weight_dtypes: ClassVar[Tuple[torch.dtype, ...]] = (torch.float32,)
    # Whether forward() takes out=None and returns a fresh bf16 [T, H] tensor of its own making: the layer then
    # leaves a call without `out` to it (a kernel backend keys its in-place graphs by buffer addresses, and a
    # fresh output's address is the allocator's choice).
    allocates_output: ClassVar[bool] = False
    # Whether it reaches its peers by P2P (one NVLink domain): a layer over several NVLink domains refuses it at
    # construction (moe_ep/split/topology.py), and backend="auto" plans a split path there.
    needs_p2p: ClassVar[bool] = False
    # What the layer is called (MoELayer's name, set before prepare_weights): for a backend's own messages.
    layer_name: str = ""

    def __init__(self, spec: MoESpec, ctx: RankContext, fmt: Optional[str] = None):
        self.spec = spec
        self.ctx = ctx
        self.fmt = fmt or self.weight_formats[0]

    @classmethod
    def check_spec(cls, spec: MoESpec, fmt: str, world_size: int) -> List[Tuple[str, str]]:
        """(argument, message) for each rule this backend cannot meet; empty when it can serve the layer."""
        return format_violations(fmt, spec.hidden_size, spec.intermediate_size)

    def agreement(self) -> Dict[str, object]:
        """What else must be equal on every rank for this layer, beyond what the layer compares itself (the spec,
        the format, the options): field -> value (JSON-able: ints, strings, lists). Called after __init__ and before
        prepare_weights, inside the layer's construction agreement; a kernel backend resolves its knob set here,
        before any workspace exists. Default: nothing more."""
        return {}

    def prepare_weights(self, weights: ExpertWeights) -> None:
        """Once, at load: the layer's weights -> the kernel-ready layout. An ExpertWeights (canonical bf16) is
        quantized into self.fmt; a QuantizedExpertWeights (already in self.fmt) is laid out as it is. The result is
        the backend's own memory: it never aliases the caller's tensors (a caller may reuse them for the next
        layer; replace_experts writes in place)."""
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                out: Optional[torch.Tensor]) -> torch.Tensor:
        """Writes out (bf16 [T, H]) and returns it; out is None only when `allocates_output`."""
        raise NotImplementedError

    def oracle_weights(self) -> QuantizedWeights:
        """The quantized weights forward() actually used, canonical layout, this rank's experts."""
        raise NotImplementedError

    def replace_experts(self, local_slots: List[int], weights: QuantizedWeights) -> None:
        """Write `weights` (len(local_slots) experts, this backend's format, canonical layout; checked by the layer)
        over this rank's slots `local_slots`, in place: the tensors forward() reads keep their addresses (compiled
        kernels and captured graphs stay valid) and hold, for those slots, the bytes a fresh load of the same
        experts would. Enqueued on the current stream (docs/eplb.md). Optional: a backend without it refuses swaps."""
        raise NotImplementedError

    def staged_activation(self):
        """The quantized FC1 input of the last forward (a moe_ep.formats.QuantizedActivation), or
        None if the backend does not keep it; the oracle then quantizes the bf16 input itself."""
        return None

    @property
    def apply_topk_in_fc1(self) -> bool:
        """Whether routing weights are folded into the SwiGLU output before the FC2-input quantization."""
        return True

    def close(self) -> None:
        pass
