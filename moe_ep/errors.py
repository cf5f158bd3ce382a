"""Typed errors of moe_ep.

Every error raised for a bad argument names that argument (``err.argument``) and says what was expected,
so a caller can tell a wrong dtype from a wrong shape without parsing text. Each one also subclasses the
builtin a Python caller would reach for (TypeError for dtypes, ValueError for values and shapes,
RuntimeError for process-group state), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = [
    "MoEError", "InputError", "DTypeError", "ShapeError", "TopKMismatchError", "DeviceError",
    "NonContiguousError", "ExpertIndexError", "CapacityError", "GradientError", "SpecError", "FormatError",
    "CalibrationError", "WeightValueError", "WorldSizeError", "WeightsRankError", "ProcessGroupError", "PeerValidationError",
    "BackendNotFoundError", "BackendUnavailableError", "OracleMismatchError", "KnobError", "TuningError",
    "ProcessGroupEnvError", "WorkspaceError", "WatchdogConfigError", "LayerClosedError", "LayerCopyError", "RegistrationError",
    "RankDivergenceError", "PeerLostError", "RankDisagreementError", "UnknownArgumentError",
    "DeviceUnavailableError",
    "CheckConfigError", "IntegrationError",
    "ExpertMapError", "LoadCountsError",
    "CheckpointError", "InexactCheckpointError",
    "TopologyError",
]


class MoEError(Exception):
    """Base of every moe_ep error. ``argument`` is the offending argument's name (or None)."""

    def __init__(self, argument: Optional[str], message: str):
        self.argument = argument
        self.detail = message
        text = f"argument '{argument}': {message}" if argument else message
        super().__init__(text)

    def __reduce__(self):  # keep the argument when an error crosses a process boundary
        return (_rebuild, (type(self), self.argument, self.detail, self.__dict__))


def _rebuild(cls, argument, detail, state):
    err = cls.__new__(cls)
    MoEError.__init__(err, argument, detail)
    err.__dict__.update(state)
    return err


class InputError(MoEError, ValueError):
    """A forward() input is unusable. Local to one rank: the layer turns it into a collective decision."""


class DTypeError(InputError, TypeError):
    pass


class ShapeError(InputError):
    pass


class TopKMismatchError(ShapeError):
    """topk_idx / topk_weights do not carry the spec's top_k, or disagree with each other."""


class DeviceError(InputError):
    pass


class NonContiguousError(InputError):
    pass


class ExpertIndexError(InputError):
    """An expert id is below -1 or >= num_experts (-1 means "no expert" for that slot)."""


class CapacityError(InputError):
    """More tokens than the workspace was sized for (max_tokens_per_rank)."""


class GradientError(InputError):
    """A forward that needs a gradient (an input requires grad under grad mode): moe_ep computes none, and an output
    without a graph would leave every gradient through the layer silently out."""


class SpecError(MoEError, ValueError):
    """The layer description is inconsistent (sizes, clamp, a backend's divisibility rule)."""


class FormatError(MoEError, ValueError):
    """An unknown quantization format, or one the chosen backend does not serve."""


class WeightValueError(MoEError, ValueError):
    """Weights whose values the layer's format cannot hold: a non-finite bf16 weight to quantize (a block scale
    saturates on it and the block's other codes turn to zero: finite, wrong outputs)."""


class CalibrationError(MoEError, ValueError):
    """A statically scaled format (fp8_tensor, nvfp4) was asked for without activation calibration."""


class WorldSizeError(MoEError, ValueError):
    pass


class WeightsRankError(MoEError, ValueError):
    """The weight pack was built for another rank, world size or expert count."""


class ProcessGroupError(MoEError, RuntimeError):
    pass


class ProcessGroupEnvError(ProcessGroupError):
    """init_from_env: a process-group environment variable is missing, partial or malformed.
    ``argument`` names the variable; the message says what to set."""


class WorkspaceError(MoEError, RuntimeError):
    """The shared workspace cannot hold a new layer (device or symmetric-heap memory); refused on every rank
    before anything was allocated."""


class PeerValidationError(MoEError, RuntimeError):
    """Raised on the ranks whose own inputs were fine when another rank's were not.

    ``ranks`` lists the failing ranks; ``reasons`` maps rank -> that rank's error text (when known).
    """

    def __init__(self, argument: Optional[str], message: str, ranks: Sequence[int] = (), reasons=None):
        self.ranks = tuple(ranks)
        self.reasons = dict(reasons or {})
        super().__init__(argument, message)


class BackendNotFoundError(MoEError, KeyError):
    def __str__(self):  # KeyError would repr() the message
        return self.args[0] if self.args else ""


class BackendUnavailableError(MoEError, RuntimeError):
    """A registered backend cannot be loaded here (module missing, import failure, wrong arch)."""


class DeviceUnavailableError(MoEError, RuntimeError):
    """The device asked for is not on this host (no CUDA device, a CPU build of torch, an index past the last
    GPU). ``argument`` names where it was asked for (``device``, ``MOE_EP_DEVICE``, ``LOCAL_RANK``)."""


class OracleMismatchError(MoEError, AssertionError):
    """A backend's output or weights disagree with the torch oracle beyond the format's tolerance."""


class KnobError(MoEError, ValueError):
    """A kernel knob set that cannot be built: an unknown knob, a value outside what the kernel accepts, or a
    combination its constructor rejects. Raised before any compile; ``argument`` names the knob."""


class TuningError(MoEError, RuntimeError):
    """A collective autotune could not pick a winner: ranks were given different candidate lists, or every
    candidate failed on some rank (``reasons`` maps candidate index -> this rank's error)."""

    def __init__(self, argument: Optional[str], message: str, reasons=None):
        self.reasons = dict(reasons or {})
        super().__init__(argument, message)


class WatchdogConfigError(MoEError, ValueError):
    """The forward watchdog's bound is not usable: MoELayer(timeout_s=...), moe_ep.watch(timeout_s=...) or
    $MOE_EP_TIMEOUT_S is not a finite number of seconds >= 0. ``argument`` names the argument or the variable."""


class LayerClosedError(MoEError, RuntimeError):
    """The layer was closed (close(), or its with-block ended): its workspace share and graphs are gone."""


class LayerCopyError(MoEError, TypeError):
    """A layer copied or pickled: it holds a process group, a collective workspace and its place in the ranks'
    sequence of calls, none of which a copy could share or rebuild on one rank alone."""


class RegistrationError(MoEError, ValueError):
    """register_backend() was given a name, target or format list it cannot register."""


class RankDivergenceError(ProcessGroupError):
    """The ranks of a process group fell out of step: at one collective call they were not in the same layer, or
    not at the same call of it (a rank skipped a call, made one more, or called another layer). Raised before any
    output of that call is returned; every later call of the group raises it again (the ranks cannot be put back
    in step from here). ``ranks``: the group ranks out of step; ``call``: the group's collective call number where
    the ranks first differ; ``layers``: the names of the layers involved; ``seen``: group rank -> (layer, its call
    number, group call) as each rank reported it."""

    def __init__(self, argument: Optional[str], message: str, ranks: Sequence[int] = (), call: Optional[int] = None,
                 layers: Sequence[str] = (), seen=None):
        self.ranks = tuple(ranks)
        self.call = call
        self.layers = tuple(layers)
        self.seen = dict(seen or {})
        super().__init__(argument, message)


class PeerLostError(ProcessGroupError):
    """A peer of the process group is gone during one of moe_ep's collectives: its connection closed (the process
    ended or crashed) or it did not answer within the group's timeout. ``ranks``: the group ranks known to be gone
    (from the watchdog's heartbeats; empty when nothing says which); ``transport``: the transport's own words."""

    def __init__(self, argument: Optional[str], message: str, ranks: Sequence[int] = (), transport: str = ""):
        self.ranks = tuple(ranks)
        self.transport = transport
        super().__init__(argument, message)


class RankDisagreementError(ProcessGroupError):
    """The ranks built one layer differently: a field every rank must agree on (the spec, the format, the backend and
    its resolved knobs, chunking, the check schedules, the sequence check, the watchdog on or off, the out dtype, the
    expert map, the calibration, the layer's name or its position among the group's layers) has different values.
    Raised on every rank by the layer's construction agreement, before anything of the layer was built.
    ``argument``: the first field that differs; ``fields``: every field that differs; ``values``: field -> {group
    rank: that rank's value}; ``ranks``: the group ranks outside the majority (with no majority, those that differ
    from the lowest rank); ``layer``: the layer's name on this rank."""

    def __init__(self, argument: Optional[str], message: str, fields: Sequence[str] = (), values=None,
                 ranks: Sequence[int] = (), layer: Optional[str] = None):
        self.fields = tuple(fields)
        self.values = dict(values or {})
        self.ranks = tuple(ranks)
        self.layer = layer
        super().__init__(argument, message)


class UnknownArgumentError(MoEError, TypeError):
    """A keyword argument nothing takes: not MoELayer's own and not one of the chosen backend's options
    (``argument`` names it; the message lists what is taken)."""


class CheckConfigError(MoEError, ValueError):
    """MoELayer(check_values=..., collective_checks=...) or $MOE_EP_CHECKS is not a schedule the layer knows;
    ``argument`` names the argument or the variable."""


class IntegrationError(MoEError, RuntimeError):
    """A model moe_ep.integrations cannot serve as asked: its library is missing, or a module's experts are not
    what an MoE layer computes (``argument`` names the module or the option)."""


class ExpertMapError(MoEError, ValueError):
    """An expert placement (moe_ep.ExpertMap) that cannot be used: a map of the wrong length, a logical expert left
    without a slot, a replica pointing at a slot out of range or claimed twice, a map another layer size, or ranks
    given different maps for one rearrangement. ``argument`` names the offending argument."""


class LoadCountsError(MoEError, RuntimeError):
    """load_counts() on a layer built without load counters (MoELayer(..., count_load=False))."""


class CheckpointError(MoEError, ValueError):
    """A checkpoint cannot be loaded as asked: a missing tensor or file, a tensor of the wrong dtype or shape, a
    block size or format the chosen backend cannot take, a convention moe_ep does not serve. ``argument`` is the
    tensor's name (or the checkpoint's, when no single tensor is at fault); ``tensor`` and ``file`` say which
    tensor of which file."""

    def __init__(self, tensor: Optional[str], message: str, file: Optional[str] = None):
        self.tensor = tensor
        self.file = file
        super().__init__(tensor, f"{message} (file {file})" if file else message)


class InexactCheckpointError(CheckpointError):
    """Loading would change some of the checkpoint's values (moe_ep's format cannot hold them as they are) and
    exactness was asked for. ``report`` (moe_ep.checkpoint.ExactnessReport) says how many and by how much."""

    def __init__(self, tensor: Optional[str], message: str, file: Optional[str] = None, report=None):
        self.report = report
        super().__init__(tensor, message, file)


class TopologyError(ProcessGroupError):
    """The group's ranks cannot all reach each other the way the chosen backend needs (a fused kernel reaches its
    peers by NVLink P2P: one NVLink domain), or the domain map given in $MOE_EP_DOMAINS does not describe the
    group. ``ranks``: the group ranks on the far side of the gap (or the ones the map gets wrong)."""

    def __init__(self, argument: Optional[str], message: str, ranks: Sequence[int] = ()):
        self.ranks = tuple(ranks)
        super().__init__(argument, message)
