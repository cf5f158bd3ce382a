"""moe_ep: an expert-parallel MoE runtime over NVIDIA's CuTe DSL MegaMoE kernels, with a torch reference
backend that runs anywhere (and serves as the oracle).

    import moe_ep
    spec = moe_ep.MoESpec(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, max_tokens_per_rank=C)
    weights = moe_ep.ExpertWeights(w13, w2, rank=r, world_size=W, num_experts=E)
    layer = moe_ep.MoELayer(spec, weights)            # backend picked by device arch; or backend="..."
    out = layer(hidden, topk_idx, topk_weights)       # [T, H] bf16 on every rank
    module = moe_ep.MoEModule(spec, weights)          # the same as a torch.nn.Module (state_dict, load_state_dict)

Importing this package never imports a kernel tree: kernel backends load when a layer asks for them.
"""

from moe_ep.core.dist import RankContext, init_from_env
from moe_ep.core.errors import (BackendNotFoundError, BackendUnavailableError, CalibrationError, CapacityError,
                                DeviceError, DTypeError, ExpertIndexError, FormatError, InputError, MoEError,
                                NonContiguousError, OracleMismatchError, PeerValidationError, ProcessGroupError,
                                ShapeError, SpecError, TopKMismatchError, TuningError, WeightsRankError, WorldSizeError,
                                KnobError, ProcessGroupEnvError, WorkspaceError, WatchdogConfigError,
                                LayerClosedError, RegistrationError, RankDivergenceError, PeerLostError,
                                RankDisagreementError, UnknownArgumentError,
                                DeviceUnavailableError, CheckConfigError,
                                IntegrationError, ExpertMapError, LoadCountsError, CheckpointError,
                                InexactCheckpointError, TopologyError)
from moe_ep.core.backend import Backend
from moe_ep.core.graphs import capture_graph
from moe_ep.core.layer import MoELayer
from moe_ep.module import MoEModule
from moe_ep.core.registry import (BackendInfo, detect_arch, list_backends, register_backend, select_backend,
                                  unregister_backend)
from moe_ep.core.spec import MoESpec
from moe_ep.core.watchdog import WATCHDOG_EXIT_CODE, watch
from moe_ep.core.weights import ExpertWeights, QuantizedExpertWeights
from moe_ep.eplb import ExpertMap
from moe_ep.formats import FORMATS, QuantizedActivation, QuantizedWeights

__all__ = [
    "MoESpec", "ExpertWeights", "QuantizedExpertWeights", "QuantizedWeights", "QuantizedActivation", "MoELayer", "MoEModule", "Backend", "RankContext", "init_from_env",
    "FORMATS", "BackendInfo", "list_backends", "register_backend", "unregister_backend", "select_backend",
    "detect_arch", "capture_graph", "watch", "WATCHDOG_EXIT_CODE", "ExpertMap",
    "MoEError", "InputError", "DTypeError", "ShapeError", "TopKMismatchError", "DeviceError", "NonContiguousError",
    "ExpertIndexError", "CapacityError", "SpecError", "FormatError", "CalibrationError", "WorldSizeError",
    "WeightsRankError", "ProcessGroupError", "PeerValidationError", "BackendNotFoundError",
    "BackendUnavailableError", "OracleMismatchError", "KnobError", "TuningError",
    "ProcessGroupEnvError", "WorkspaceError", "WatchdogConfigError", "LayerClosedError", "RegistrationError",
    "RankDivergenceError", "PeerLostError", "RankDisagreementError", "UnknownArgumentError",
    "DeviceUnavailableError",
    "CheckConfigError", "IntegrationError",
    "ExpertMapError", "LoadCountsError",
    "CheckpointError", "InexactCheckpointError", "TopologyError",
]
