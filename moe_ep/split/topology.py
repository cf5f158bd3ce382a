"""Which ranks of a group reach each other by NVLink P2P (a domain): found once per group, at a layer's construction.

The fused kernels reach their peers by P2P loads and stores, so a fused layer must live inside one domain (an SM90
MegaMoE layer spread over two nodes dies with an illegal address: nothing checked). The split paths are built
around the map: `split` moves tokens with the transport alone, `two_level` runs a fused backend inside each domain
and the transport between domains (moe_ep/split/two_level.py).

Discovery is collective: every rank gathers the same facts (one all_gather_object) and derives the same map.
  * $MOE_EP_DOMAINS (group ranks, ',' within a domain, '|' between domains: "0,1|2,3") overrides what is found:
    the simulated map CPU tests use, and the way to declare a fabric torch cannot see (a multi-node NVLink domain).
    Every rank must set the same value.
  * On CUDA: each rank's host name, device index and the P2P reach of its device to every device of its host
    (torch.cuda.can_device_access_peer); a domain is a set of same-host ranks that all reach each other.
  * On the CPU: one domain per host (no P2P exists; the reference reaches every rank through its transport).
A rank's local index is its place in its domain (ranks in increasing order); a rail is the set of ranks with one
local index, one per domain (where two_level's transport runs).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_ep.core.dist import RankContext
from moe_ep.errors import TopologyError

__all__ = ["ENV", "DomainMap", "parse_domains", "domain_map", "require_one_domain", "forget"]

ENV = "MOE_EP_DOMAINS"


@dataclass(frozen=True)
class DomainMap:
    """domains: group ranks per domain (each in increasing order; domains ordered by their first rank); source:
    where the map came from ("one rank", "MOE_EP_DOMAINS", "cuda p2p", "hosts")."""

    domains: Tuple[Tuple[int, ...], ...]
    source: str

    @property
    def num_domains(self) -> int:
        return len(self.domains)

    @property
    def world_size(self) -> int:
        return sum(len(d) for d in self.domains)

    @property
    def uniform(self) -> bool:
        """Every domain has as many ranks (what two_level's rails need)."""
        return len({len(d) for d in self.domains}) == 1

    @property
    def domain_size(self) -> int:
        return len(self.domains[0])

    def domain_of(self, rank: int) -> int:
        return self._index()[rank][0]

    def local_rank(self, rank: int) -> int:
        return self._index()[rank][1]

    def rail(self, local: int) -> Tuple[int, ...]:
        """The rank of each domain whose local index is `local` (uniform maps)."""
        return tuple(d[local] for d in self.domains)

    def _index(self) -> Dict[int, Tuple[int, int]]:
        return {r: (i, j) for i, d in enumerate(self.domains) for j, r in enumerate(d)}

    def describe(self) -> str:
        return "|".join(",".join(str(r) for r in d) for d in self.domains)

    def __str__(self) -> str:
        return f"{self.describe()} ({self.source})"


def _canonical(domains: Sequence[Sequence[int]], source: str) -> DomainMap:
    ds = sorted((tuple(sorted(d)) for d in domains if d), key=lambda d: d[0])
    return DomainMap(tuple(ds), source)


def parse_domains(text: str, world_size: int, argument: str = ENV) -> DomainMap:
    """"0,1|2,3" -> DomainMap over group ranks [0, world_size); TopologyError unless every rank appears once."""
    seen: List[int] = []
    domains = []
    for part in str(text).split("|"):
        ranks = []
        for tok in part.split(","):
            tok = tok.strip()
            if not tok:
                continue
            try:
                ranks.append(int(tok))
            except ValueError:
                raise TopologyError(argument, f"{text!r}: expected group ranks as integers, ',' within a domain and "
                                              f"'|' between domains (e.g. '0,1|2,3'), got {tok!r}") from None
        if not ranks:
            raise TopologyError(argument, f"{text!r}: an empty domain (two '|' in a row, or one at an end)")
        domains.append(ranks)
        seen += ranks
    bad = sorted({r for r in seen if not 0 <= r < world_size})
    dup = sorted({r for r in seen if seen.count(r) > 1})
    missing = sorted(set(range(world_size)) - set(seen))
    if bad or dup or missing:
        what = "; ".join(x for x in (f"ranks {bad} are not in a group of {world_size}" if bad else "",
                                     f"ranks {dup} appear twice" if dup else "",
                                     f"ranks {missing} are in no domain" if missing else "") if x)
        raise TopologyError(argument, f"{text!r} does not place each of the group's {world_size} ranks in exactly "
                                      f"one domain: {what}", ranks=bad or dup or missing)
    return _canonical(domains, ENV)


def _reach_row(device: torch.device) -> Tuple[int, Tuple[bool, ...]]:
    """(device index, whether it reaches each device of this host by P2P); (-1, ()) on the CPU."""
    if device.type != "cuda":
        return -1, ()
    me = device.index if device.index is not None else torch.cuda.current_device()
    row = tuple(j == me or bool(torch.cuda.can_device_access_peer(me, j)) for j in range(torch.cuda.device_count()))
    return me, row


def _cliques(ranks: Sequence[int], reach) -> List[List[int]]:
    """Greedy, in rank order: a rank joins the first domain whose every member it reaches both ways."""
    out: List[List[int]] = []
    for r in ranks:
        for d in out:
            if all(reach(r, q) and reach(q, r) for q in d):
                d.append(r)
                break
        else:
            out.append([r])
    return out


def _derive(facts: List[tuple], world: int) -> DomainMap:
    envs = [f[0] for f in facts]
    errors = [(r, f[4]) for r, f in enumerate(facts) if f[4]]
    if errors:
        r, text = errors[0]
        raise TopologyError(ENV, f"rank {r} could not describe its device: {text}", ranks=[e[0] for e in errors])
    if len(set(envs)) > 1:
        groups: Dict[Optional[str], List[int]] = {}
        for r, e in enumerate(envs):
            groups.setdefault(e, []).append(r)
        shown = "; ".join(f"ranks {rs}: {e!r}" if e is not None else f"ranks {rs}: unset" for e, rs in groups.items())
        raise TopologyError(ENV, f"the ranks set different domain maps ({shown}); set the same value on every rank",
                            ranks=[r for rs in list(groups.values())[1:] for r in rs])
    if envs[0] is not None:
        return parse_domains(envs[0], world)
    hosts: Dict[str, List[int]] = {}
    for r, f in enumerate(facts):
        hosts.setdefault(f[1], []).append(r)
    cuda = all(f[2] >= 0 for f in facts)

    def reach(p: int, q: int) -> bool:
        _, _, dev_q, _, _ = facts[q]
        row = facts[p][3]
        return 0 <= dev_q < len(row) and row[dev_q]

    domains = []
    for ranks in hosts.values():
        domains += _cliques(ranks, reach) if cuda else [ranks]
    return _canonical(domains, "cuda p2p" if cuda else "hosts")


_cache: Dict[tuple, DomainMap] = {}


def domain_map(ctx: RankContext) -> DomainMap:
    """The group's domain map (collective on its first use per group and $MOE_EP_DOMAINS value; cached after).
    A local failure (a malformed map, a device that cannot be asked) is raised on every rank after the gather, so
    no rank is left waiting in it."""
    env = os.environ.get(ENV)
    env = env.strip() if env is not None and env.strip() else None
    if ctx.world_size == 1 or ctx.pg_backend == "none":
        return parse_domains(env, ctx.world_size) if env is not None else _canonical([[0]], "one rank")
    key = (id(ctx.group) if ctx.group is not None else None, ctx.world_size, str(ctx.device), env)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    try:
        dev, row = _reach_row(ctx.device)
        mine = (env, socket.gethostname(), dev, row, "")
    except Exception as e:  # noqa: BLE001 - said on every rank after the gather
        mine = (env, "", -1, (), f"{type(e).__name__}: {e}")
    facts: List[Optional[tuple]] = [None] * ctx.world_size
    dist.all_gather_object(facts, mine, group=ctx.group)
    dmap = _derive(facts, ctx.world_size)
    _cache[key] = dmap
    return dmap


def forget() -> None:
    """Drop the cached maps (a test that rebuilds groups under the same ids)."""
    _cache.clear()


def require_one_domain(dmap: DomainMap, backend: str) -> None:
    """TopologyError naming the ranks a fused backend could not reach, when the group spans several domains."""
    if dmap.num_domains <= 1:
        return
    first = list(dmap.domains[0])
    rest = [r for d in dmap.domains[1:] for r in d]
    raise TopologyError("backend", (
        f"{backend!r} reaches its peers by NVLink P2P, which needs every rank of the group in one NVLink domain; this "
        f"group spans {dmap.num_domains} domains ({dmap}): ranks {first} cannot reach ranks {rest} by P2P. Use "
        f"backend='auto' (it plans 'two_level' or 'split' here), 'two_level' (the fused kernel inside each domain, "
        f"the transport between them) or 'split' (the transport alone)"), ranks=rest)
