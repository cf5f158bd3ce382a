"""Rank-side cases of the fault matrix (tests/moe_ep/fault_matrix_test.py): every rank runs them in one process, each
case on a process group of its own (a group that fell out of step stays refused), and returns one JSON-able record a
case, so the test process asserts on every rank's view.

Every output a rank is handed is compared, byte for byte, with what the same layer returned for the same inputs while
every rank was in step (the torch reference is deterministic): `wrong` counts the outputs that differ.

matrix(): construction faults (ranks that build one layer differently), ranks out of step (skip / extra / wrong
layer, the watchdog's timer on and off, the layers' checks on and off, two layers of the same or of another geometry),
an unwatched call, a bad expert id with the checks off and on, device="cpu:0", unknown keywords.
`python fault_cases.py OUT KILL_RANK` (under tools/launch): a rank dies inside a call of a chunking="agree" layer;
the survivors record what they raised, then end normally (their exit code is the test's to check)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import moe_ep
from moe_ep.core import op
from moe_ep.core.dist import init_from_env
from moe_ep.core.watchdog import monitor, sequence
from moe_ep.testing.problems import Problem

H, I, K, T = 128, 64, 2, 4
MARK = "fault_cases: the first PeerLostError was raised"
FAULT_CALL = 5        # the loop call the fault hits (odd: an L1 call; each layer made one warm-up call before)
CALLS = 8             # loop calls per out-of-step case


def _experts(world: int) -> int:
    return 2 * world


def _problem(world: int, hidden: int = H, experts=None, top_k: int = K, capacity: int = T, seed: int = 3):
    spec = moe_ep.MoESpec(hidden, I, experts or _experts(world), top_k, capacity)
    return spec, Problem.build(spec, world, T, "balanced", seed=seed)


def _error(e: BaseException, t0: float) -> dict:
    return {"type": type(e).__name__, "argument": getattr(e, "argument", None), "message": str(e),
            "ranks": list(getattr(e, "ranks", ()) or ()), "fields": list(getattr(e, "fields", ()) or ()),
            "call": getattr(e, "call", None), "s": round(time.perf_counter() - t0, 4), "t": time.time()}


def _built():
    """What a layer leaves behind in this process: op handles, open callers of the sequence logs, watches."""
    return {"handles": len(op._layers), "open": sum(lg.open for lg in sequence.logs()),
            "watches": len(monitor.get().watches)}


# -- construction: every rank agrees, or nothing is built -------------------------------------------------------------
def _construction_cases(world: int, rank: int):
    odd = rank == world - 1  # the rank that builds differently
    cases = {
        "num_experts": dict(experts=4 * world if odd else 2 * world),
        "hidden_size": dict(hidden=256 if odd else H),
        "top_k": dict(top_k=1 if odd else K),
        "capacity": dict(capacity=2 * T if odd else T),
        "fmt": dict(fmt="bf16" if odd else "mxfp8"),
        "checks_env_all": dict(env={"MOE_EP_CHECKS": "all"} if odd else {}),
        "chunking": dict(chunking="agree" if odd else "strict"),
        "out_dtype": dict(out_dtype=torch.float32 if odd else None),
        "name": dict(name=f"model{int(odd)}.layers.3.mlp.experts"),
        "watchdog": dict(timeout_s=0 if odd else 30),
        "sequence_check": dict(sequence_check=not odd),
        "backend_option": dict(apply_topk_in_fc1=not odd),
        "expert_map": dict(expert_map=(moe_ep.ExpertMap.round_robin(2 * world, 4 * world) if odd else
                                       moe_ep.ExpertMap.from_replicas([[2 * e, 2 * e + 1] for e in range(2 * world)],
                                                                      num_slots=4 * world))),
        "calibration": dict(fmt="fp8_tensor", amax=(2.0 if odd else 3.0)),
        "unknown_keyword_one_rank": dict(bogus_option=1) if odd else {},
        "unknown_keyword_every_rank": dict(bogus_option=1),
        "device_cpu1": dict(device="cpu:1") if odd else {},
    }
    return cases


def _build(world, rank, group, kw):
    kw = dict(kw)
    env = kw.pop("env", {})
    spec, p = _problem(world, kw.pop("hidden", H), kw.pop("experts", None), kw.pop("top_k", K), kw.pop("capacity", T))
    amax = kw.pop("amax", None)
    expert_map = kw.get("expert_map")
    if expert_map is not None:
        g13, g2 = p.global_weights()
        weights = expert_map.rank_weights(g13, g2, rank, world)
    else:
        weights = p.rank_weights(rank)
    if amax is not None:
        weights.act_amax, weights.fc2_act_amax = amax, amax
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return moe_ep.MoELayer(spec, weights, group=group, **kw), p
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _construction(world: int, rank: int) -> dict:
    out = {}
    for case, kw in _construction_cases(world, rank).items():
        group = dist.new_group(list(range(world)))
        before = _built()
        t0 = time.perf_counter()
        rec = {"error": None}
        try:
            layer, p = _build(world, rank, group, kw)
            rec["built"] = True
            layer.close()
        except moe_ep.MoEError as e:
            rec["error"] = _error(e, t0)
        rec["left"] = {k: _built()[k] - v for k, v in before.items()}
        out[case] = rec
    # Two ranks that load different models with equal layer shapes (the name is the module path an integration
    # passes): the last rank's model has one layer more in front; every construction is refused, on every rank.
    group = dist.new_group(list(range(world)))
    names = ["extra", "layers.0", "layers.1"] if rank == world - 1 else ["layers.0", "layers.1", "layers.2"]
    rec = {"errors": []}
    for name in names:
        t0 = time.perf_counter()
        try:
            layer, _ = _build(world, rank, group, {"name": name})
            layer.close()
            rec["errors"].append(None)
        except moe_ep.MoEError as e:
            rec["errors"].append(_error(e, t0))
    out["extra_layer"] = rec
    return out


# -- every call: ranks in step, or a typed error before any wrong output ----------------------------------------------
def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool((a == b).all())


def _loop(world, rank, kind, tag, *, timer=True, checks=True, geometry="same", seq=True, fault_rank=None,
          backend=None, options=None):
    """Two layers L1 and L2 called alternately (L1 at odd loop calls); rank `fault_rank` (default: the last) does
    `kind` at loop call FAULT_CALL. kind: skip | extra | wrong | none | unwatched | bad_id."""
    fault_rank = world - 1 if fault_rank is None else fault_rank
    group = dist.new_group(list(range(world)))
    on = None if checks else False
    layers, inputs, refs = [], [], []
    for k, hidden in enumerate((H, H if geometry == "same" else 2 * H)):
        spec, p = _problem(world, hidden, seed=10 + k)
        layers.append(moe_ep.MoELayer(spec, p.rank_weights(rank), backend=backend, group=group,
                                      timeout_s=30 if timer else 0, check_values=on, collective_checks=on,
                                      sequence_check=seq, name=f"{tag}.L{k + 1}", **(options or {})))
        inputs.append(p.inputs(rank))
    for layer, x in zip(layers, inputs):  # in step: what each layer returns for these inputs
        refs.append(layer(*x).clone())
    plan = []
    for i in range(1, CALLS + 1):
        k = 0 if i % 2 else 1
        if rank == fault_rank and i == FAULT_CALL:
            if kind == "skip":
                continue
            if kind == "wrong":
                k = 1 - k
            if kind == "extra":
                plan.append((i, k, None))
        plan.append((i, k, kind if (rank == fault_rank and i == FAULT_CALL) else None))
    rec = {"returned": 0, "wrong": 0, "errors": [], "fault_t": None}
    dist.barrier(group=group)
    for i, k, fault in plan:
        hidden, idx, w = inputs[k]
        if fault is not None:
            rec["fault_t"] = time.time()
        if fault == "unwatched":
            layers[k].watched = False
        if fault == "bad_id":
            idx = idx.clone()
            idx[0, 0] = layers[k].spec.num_experts
        t0 = time.perf_counter()
        try:
            got = layers[k](hidden, idx, w)
            rec["returned"] += 1
            rec["wrong"] += not _same(got, refs[k])
        except moe_ep.MoEError as e:
            rec["errors"].append(dict(_error(e, t0), loop_call=i))
            if isinstance(e, (moe_ep.RankDivergenceError, moe_ep.PeerLostError)):
                t1 = time.perf_counter()
                try:  # every later call of the group: refused at once, with the same error
                    layers[1 - k](*inputs[1 - k])
                    rec["next_call"] = "returned"
                except moe_ep.MoEError as e2:
                    rec["next_call"] = _error(e2, t1)
                break
        finally:
            if fault == "unwatched":
                layers[k].watched = True
    for layer in layers:
        layer.close()
    return rec


KINDS = ("skip", "extra", "wrong")


def out_of_step_cases():
    """name -> _loop keywords: each kind with the timer on / off, the checks on / off, the same / another geometry."""
    cases = {}
    for kind in KINDS:
        for timer in (True, False):
            for checks in (True, False):
                for geometry in ("same", "other"):
                    name = f"{kind}/{'timer' if timer else 'no_timer'}/{'checks' if checks else 'no_checks'}/{geometry}"
                    cases[name] = dict(kind=kind, timer=timer, checks=checks, geometry=geometry)
    # With the sequence check off, a geometry mismatch is still a typed error (the row widths, before the payload).
    cases["skip/seq_off/other"] = dict(kind="skip", timer=False, checks=False, geometry="other", seq=False)
    cases["unwatched/timer"] = dict(kind="unwatched", timer=True)
    cases["bad_id/no_checks"] = dict(kind="bad_id", checks=False)
    cases["bad_id/checks"] = dict(kind="bad_id", checks=True)
    cases["bad_id/no_checks/chunking"] = dict(kind="bad_id", checks=False, options={"chunking": "agree"})
    cases["none/cpu0"] = dict(kind="none", options={"device": "cpu:0"})
    return cases


def matrix(names=None) -> dict:
    ctx = init_from_env()
    world, rank = ctx.world_size, ctx.rank
    out = {"construction": _construction(world, rank), "calls": {}}
    for name, kw in out_of_step_cases().items():
        if names is None or name in names:
            out["calls"][name] = _loop(world, rank, tag=name, **kw)
    # Documented risk of the off switch: with the sequence check off, a call to the wrong layer of one geometry goes
    # unseen (recorded, not part of the 0-wrong-outputs matrix; a wrong call keeps the ranks' call counts equal).
    out["seq_off_same_geometry"] = _loop(world, rank, "wrong", "seq_off_same", timer=False, checks=False, seq=False)
    return out


# -- a peer dies (its own launch: the survivors' group is gone afterwards) -------------------------------------------
def dead_peer(out_dir: str, kill_rank: int) -> None:
    ctx = init_from_env()
    world, rank = ctx.world_size, ctx.rank
    spec, p = _problem(world)
    layer = moe_ep.MoELayer(spec, p.rank_weights(rank), chunking="agree", timeout_s=30, name="dead.L1")
    hidden, idx, w = p.inputs(rank)
    ref = layer(hidden, idx, w).clone()
    rec = {"rank": rank, "returned": 0, "wrong": 0, "errors": []}
    # The survivors name the dead rank by its heartbeat that stopped; a rank that dies before its first beat reached
    # the store cannot be named (that is the watchdog-off case), and a rank that starts quickly gets to the fault call
    # within the first beat's half second. So every rank waits until its heartbeat has been written (beat 2 is
    # counted after beat 1's write).
    deadline = time.monotonic() + 10.0
    while monitor.get().beat < 2:
        assert time.monotonic() < deadline, f"rank {rank}: no watchdog heartbeat within 10 s"
        time.sleep(0.05)
    dist.barrier()
    for i in range(1, CALLS + 1):
        if rank == kill_rank and i == FAULT_CALL:
            Path(out_dir, "fault_t").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.perf_counter()
        try:
            got = layer(hidden, idx, w)
            rec["returned"] += 1
            rec["wrong"] += not _same(got, ref)
        except moe_ep.MoEError as e:
            rec["errors"].append(dict(_error(e, t0), loop_call=i))
            if len(rec["errors"]) == 1:
                print(MARK, flush=True)  # the test reads the log from here on: nothing more may come from c10d
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rec))
    # Ends normally (the interpreter's own exit, atexit hooks included): the test checks the exit code.


if __name__ == "__main__":
    torch.set_num_threads(1)
    dead_peer(sys.argv[1], int(sys.argv[2]))
