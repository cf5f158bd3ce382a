"""Ranks out of step: where their sequences of collective calls part, who left the others, and the message.

Pure but for in_band(), which marks the group's log. Inputs are what sequence.py keeps and publishes:
checkpoints (group call number -> digest of every call up to it) and entries (identity, call number) per group
call. Identities are the same on every rank, so one rank's names table names every rank's calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from moe_ep.errors import RankDivergenceError

__all__ = ["compare", "Finding", "analyze", "format_message", "in_band", "error"]

SHIFT_WINDOW = 8   # entries compared to tell a skipped call or an extra one from a different one
SHIFT_MIN = 2      # ... at least this many, or it is not told


def compare(mine: Dict[int, str], theirs: Dict[int, str]) -> Optional[Tuple[int, int]]:
    """None while the newest checkpoint both have agrees (chained: every call up to it agrees), or when they share
    none yet; else (s0, s1): the ranks agree on every call up to s0 (0: no shared checkpoint agrees) and differ at
    or before s1."""
    common = sorted(set(mine) & set(theirs))
    if not common or mine[common[-1]] == theirs[common[-1]]:
        return None
    s0 = 0
    for s in common:
        if mine[s] != theirs[s]:
            return s0, s
        s0 = s
    return None  # not reached: the newest differs


@dataclass
class Finding:
    """call: the first group call where the ranks differ (None: the entries kept no longer show it);
    seen: group rank -> (identity, its call number) at that call, for every rank that reported one;
    ref_rank: the rank the others are compared with (the majority's lowest); out: the ranks out of step;
    how: group rank -> what it did ("left out ...", "made ... where ..."); layers: identities involved."""
    call: Optional[int]
    seen: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    ref_rank: Optional[int] = None
    out: List[int] = field(default_factory=list)
    how: Dict[int, str] = field(default_factory=dict)
    layers: List[int] = field(default_factory=list)


def _name(names: Dict[int, str], code: int) -> str:
    return names.get(code, f"layer #{code // 2}" if code % 2 == 0 else f"collective watch #{code // 2}")


def _call(names: Dict[int, str], entry: Tuple[int, int]) -> str:
    return f"{_name(names, entry[0])!r} call {entry[1]}"


def analyze(entries: Dict[int, Tuple[int, Sequence[int], Sequence[int]]], s0: int,
            names: Dict[int, str]) -> Finding:
    """entries: group rank -> (first group call number kept, identities, call numbers), from s0 + 1 on where
    kept. Finds the first group call where two ranks differ, the majority there, and for each rank out of step
    whether it left a call out or made one too many (its identities are the reference's shifted by one)."""
    def at(r: int, s: int) -> Optional[Tuple[int, int]]:
        first, codes, calls = entries[r]
        i = s - first
        return (codes[i], calls[i]) if 0 <= i < len(codes) else None

    ranks = sorted(entries)
    start = max([s0 + 1] + [entries[r][0] for r in ranks])
    end = max([entries[r][0] + len(entries[r][1]) for r in ranks] + [start])
    for s in range(start, end):
        seen = {r: e for r in ranks if (e := at(r, s)) is not None}
        if len(set(seen.values())) < 2:
            continue
        counts: Dict[Tuple[int, int], int] = {}
        for e in seen.values():
            counts[e] = counts.get(e, 0) + 1
        ref = max(counts, key=lambda e: (counts[e], -min(r for r in seen if seen[r] == e)))
        ref_rank = min(r for r in seen if seen[r] == ref)
        out = [r for r in seen if seen[r] != ref]
        how, layers = {}, [ref[0]]
        for r in out:
            how[r] = _how(at, r, ref_rank, s, names)
            if seen[r][0] not in layers:
                layers.append(seen[r][0])
        return Finding(s, seen, ref_rank, out, how, sorted(layers))
    return Finding(None)


def _how(at, r: int, q: int, s: int, names: Dict[int, str]) -> str:
    """What rank r did at group call s, against rank q's calls."""
    def codes(rank, a, n):
        out = []
        for k in range(a, a + n):
            e = at(rank, k)
            if e is None:
                break
            out.append(e[0])
        return out

    def shifted(x, y):
        n = min(len(x), len(y))
        return n >= SHIFT_MIN and x[:n] == y[:n]

    mine, theirs = at(r, s), at(q, s)
    windows = (codes(r, s, SHIFT_WINDOW), codes(q, s + 1, SHIFT_WINDOW),   # r one early against q
               codes(r, s + 1, SHIFT_WINDOW), codes(q, s, SHIFT_WINDOW))   # r one late against q
    skipped, extra = shifted(*windows[:2]), shifted(*windows[2:])
    if skipped and extra:
        return (f"left out {_call(names, theirs)}, or made {_call(names, mine)} one time too many (from the calls "
                "alone the two look the same); its calls from there on are rank "
                f"{q}'s shifted by one")
    if skipped:
        return f"left out {_call(names, theirs)}: its calls from there on are rank {q}'s, one early"
    if extra:
        return f"made {_call(names, mine)} one time too many: its calls from there on are rank {q}'s, one late"
    if min(map(len, windows)) < SHIFT_MIN:  # the watchdog stopped the ranks within a call or two: guess nothing
        return (f"made {_call(names, mine)} where rank {q} made {_call(names, theirs)} (too few calls were made "
                "after it to tell a call left out, one made too many and a different one apart)")
    return f"made {_call(names, mine)} where rank {q} made {_call(names, theirs)}"


def _ranks(rs: Sequence[int]) -> str:
    return ", ".join(f"rank {r}" for r in rs) or "none"


def format_message(f: Finding, *, names: Dict[int, str], rank: int, world: int, ranks: Sequence[int],
                   noticed: str, after: Optional[int] = None, s1: Optional[int] = None,
                   missing: Sequence[int] = (), note: str = "", ending: bool = True) -> str:
    """The one message of a divergence. rank / world: this process in the group (ranks: its global ranks);
    noticed: how it was seen; after: how many collective calls this rank made after the first diverging one."""
    group = f"the group of global ranks [{', '.join(str(r) for r in ranks)}]"
    if f.call is None:
        lines = [f"moe_ep watchdog: rank {rank} of {world}: the ranks' collective calls differ at or before group "
                 f"call {s1} of {group} ({noticed}), but the calls kept no longer show which came first."]
    else:
        lines = [f"moe_ep watchdog: rank {rank} of {world}: the ranks fell out of step at group call {f.call} of "
                 f"{group} ({noticed})."]
        lines.append("  at that call: " + "; ".join(
            f"rank {r}{' (this rank)' if r == rank else ''} made {_call(names, e)}" for r, e in sorted(f.seen.items())))
        lines.append(f"  out of step: {_ranks(f.out)} (against rank {f.ref_rank}"
                     f"{', the majority' if len(f.seen) > 2 else ''})")
        for r in f.out:
            lines.append(f"    rank {r}: {f.how[r]}")
        lines.append("  layers involved: " + ", ".join(repr(_name(names, c)) for c in f.layers))
        lines.append(f"  From group call {f.call} on, the ranks' calls met other layers' (or other calls') data in "
                     "the exchange: their outputs are wrong.")
        if after is not None and after > 0:
            lines.append(f"  This rank made {after} collective call(s) after it before this was seen; every later "
                         "call of the group is refused.")
    if missing:
        lines.append(f"  no answer from {_ranks(missing)} (gone, or its watchdog did not reply in time)")
    if note:
        lines.append(f"  note: {note}")
    if ending:
        lines.append("  Ranks out of step cannot be put back in step from the host (a persistent kernel may wait for a "
                     "call that never comes): this process ends now (exit code 86).")
    return "\n".join(lines) + "\n"


def error(f: Finding, *, names: Dict[int, str], text: str) -> RankDivergenceError:
    layers = [_name(names, c) for c in f.layers]
    seen = {r: (_name(names, e[0]), e[1], f.call) for r, e in f.seen.items()}
    return RankDivergenceError(None, text, ranks=f.out, call=f.call, layers=layers, seen=seen)


def in_band(log, mine: Tuple[int, int, int], rows: Sequence[Sequence[int]]) -> None:
    """A backend that carried every rank's fingerprint (identity, call number, group call) in its exchange: raise
    RankDivergenceError on every rank when they differ, before this call returns anything, and refuse every later
    call of the group. Zeros are a call that logs nothing (a layer built with its sequence check off, on every rank
    alike): zeros on every rank agree, zeros against a fingerprint are ranks in different layers."""
    m = list(mine)
    if all(list(row) == m for row in rows):  # in step: the hot path's case
        return
    rows = [tuple(int(v) for v in row) for row in rows]
    if not any(row[0] for row in rows):
        return
    names = dict(log.names)
    names.setdefault(0, "a layer with its sequence check off")
    entries = {r: (row[2], [row[0]], [row[1]]) for r, row in enumerate(rows)}
    calls = {row[2] for row in rows}
    if len(calls) > 1:  # the ranks count different group calls: compare what each is in now, side by side
        entries = {r: (0, [row[0]], [row[1]]) for r, row in enumerate(rows)}
    f = analyze(entries, -1, names)
    f.call = max(calls) if len(calls) > 1 else f.call
    seen = "; ".join(f"rank {r}{' (this rank)' if r == log.group_rank else ''} is in {_call(names, row[:2])} "
                     f"(group call {row[2]})" for r, row in enumerate(rows))
    layers = ", ".join(repr(_name(names, c)) for c in f.layers)
    text = (f"the ranks of the group of global ranks [{', '.join(str(r) for r in log.ranks)}] fell out of step: "
            f"{seen}. Out of step: {_ranks(f.out)} (against rank {f.ref_rank}); layers involved: {layers}. Seen in "
            "the exchange before any output of this call was returned; every later call of this group raises this "
            "error (the ranks cannot be put back in step: rebuild the group or restart the job).")
    err = error(f, names=names, text=text)
    err.seen = {r: (_name(names, row[0]), row[1], row[2]) for r, row in enumerate(rows)}
    log.mark(err)
    raise err
