"""moe_ep: an expert-parallel MoE runtime over NVIDIA's CuTe DSL MegaMoE kernels, with a torch reference
backend that runs anywhere (and serves as the oracle).

    import moe_ep
    spec = moe_ep.MoESpec(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, max_tokens_per_rank=C)
    weights = moe_ep.ExpertWeights(w13, w2, rank=r, world_size=W, num_experts=E)
    layer = moe_ep.MoELayer(spec, weights)            # backend picked by device arch; or backend="..."
    out = layer(hidden, topk_idx, topk_weights)       # [T, H] bf16 on every rank
    module = moe_ep.MoEModule(spec, weights)          # the same as a torch.nn.Module (state_dict, load_state_dict)

Errors: every one is a moe_ep.MoEError naming the argument; the ones a caller commonly catches are here, all of
them in moe_ep.errors. Importing this package never imports a kernel tree: kernel backends load when a layer asks
for them.
"""

from moe_ep import errors
from moe_ep.core.backend import Backend
from moe_ep.core.dist import RankContext, init_from_env
from moe_ep.core.graphs import capture_graph
from moe_ep.core.registry import (BackendInfo, detect_arch, list_backends, register_backend, select_backend,
                                  unregister_backend)
from moe_ep.core.spec import MoESpec
from moe_ep.core.watchdog import WATCHDOG_EXIT_CODE, watch
from moe_ep.core.weights import ExpertWeights, QuantizedExpertWeights
from moe_ep.eplb import ExpertMap
from moe_ep.errors import (BackendUnavailableError, CalibrationError, CapacityError, CheckpointError, FormatError,
                           InputError, MoEError, PeerLostError, PeerValidationError, ProcessGroupError,
                           RankDivergenceError, SpecError)
from moe_ep.formats import FORMATS, QuantizedActivation, QuantizedWeights
from moe_ep.layer import MoELayer
from moe_ep.module import MoEModule

__all__ = [
    # layers, weights, backends
    "MoESpec", "ExpertWeights", "QuantizedExpertWeights", "QuantizedWeights", "QuantizedActivation", "MoELayer",
    "MoEModule", "Backend", "RankContext", "init_from_env", "FORMATS", "BackendInfo", "list_backends",
    "register_backend", "unregister_backend", "select_backend", "detect_arch", "capture_graph", "watch",
    "WATCHDOG_EXIT_CODE", "ExpertMap",
    # the errors a caller commonly catches (the rest: moe_ep.errors)
    "MoEError", "InputError", "CapacityError", "SpecError", "FormatError", "CalibrationError",
    "BackendUnavailableError", "ProcessGroupError", "PeerValidationError", "RankDivergenceError", "PeerLostError",
    "CheckpointError",
]


def __getattr__(name):
    if name in errors.__all__:  # an error kept in moe_ep.errors only: say where it is
        raise AttributeError(f"module 'moe_ep' has no attribute {name!r}; it is moe_ep.errors.{name}")
    raise AttributeError(f"module 'moe_ep' has no attribute {name!r}")
