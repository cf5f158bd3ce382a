"""The split paths' few hooks into MoELayer (moe_ep/layer.py): the group's domain map at construction, the
topology refusal of fused backends, the default format of the path backends, and the layer's plan."""

from __future__ import annotations

from moe_ep.split import topology

__all__ = ["domain_map", "check_topology", "default_format", "plan_of"]

PATHS = ("split", "two_level", "auto")

domain_map = topology.domain_map


def check_topology(cls, name: str, dmap: topology.DomainMap) -> None:
    """A backend that reaches its peers by P2P (its class says `needs_p2p`) is refused on a group of several NVLink
    domains (TopologyError naming the ranks it cannot reach)."""
    if cls.needs_p2p:
        topology.require_one_domain(dmap, name)


def default_format(entry, device) -> str:
    """The path backends run the format the device's own backend would (FP8 blockwise on a Hopper GPU, bf16 on the
    CPU); any other entry its own default."""
    if entry.name not in PATHS:
        return entry.default_format
    import warnings

    from moe_ep.core import registry

    with warnings.catch_warnings():  # no kernel here: the reference's default, which select_backend would warn of
        warnings.simplefilter("ignore", RuntimeWarning)
        return registry.select_backend(registry.detect_arch(device)).default_format


def plan_of(layer):
    from moe_ep.split.plan import plan_of as describe

    return describe(layer)
