"""Rank-side functions of the EPLB tests (run by tools/launch on every rank; loaded by file path). They return
JSON-able records of what each rank saw, so the test process asserts on every rank's view.

The geometry is one every backend serves (H, I multiples of 128), so the same functions run the torch reference on
CPU ranks and the Hopper kernels on GPUs (eplb_multirank_test.py reads MOE_EP_TEST_BACKEND / _DEVICE / _WORLD_SIZES).
"""

from __future__ import annotations

import hashlib
from dataclasses import fields, is_dataclass

import torch

import moe_ep
from moe_ep.core.dist import init_from_env
from moe_ep.formats import format_info, quantize_weights
from moe_ep.reference.oracle import OUTPUT_TOLERANCE, check_multirank, compare, kernel_row_tolerance
from moe_ep.testing.scenario import error_record

H, I, E, K = 256, 128, 8, 4
CAPACITY = 48
HOT = 0  # the logical expert the routing favours


def slots_per_rank(world: int) -> int:
    """One spare slot per rank beyond an even share of the logical experts."""
    return -(-E // world) + 1


def initial_map(world: int) -> moe_ep.ExpertMap:
    """Slots 0..E-1 hold experts 0..E-1 (contiguous blocks per rank); the spare slots past them replicate cold experts
    E-1, E-2, ... So the hot expert starts with one slot."""
    num_slots = slots_per_rank(world) * world
    return moe_ep.ExpertMap([s if s < E else E - 1 - (s - E) % (E - 1) for s in range(num_slots)], E)


def swapped_map(emap: moe_ep.ExpertMap) -> moe_ep.ExpertMap:
    """The last slot takes the hot expert (a replica on the last rank); slots 1 and E-1 trade experts (across ranks
    when world > 1: each one's source is the other's destination, so both are read before either is written)."""
    return emap.reassign({emap.num_slots - 1: HOT, 1: E - 1, E - 1: 1})


def logical_weights(seed: int = 3):
    """Every logical expert's canonical bf16 weights (all ranks draw the same)."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16)
    return w13, w2


def calibration(fmt: str) -> dict:
    return dict(act_amax=5.0, fc2_act_amax=0.5) if format_info(fmt).static_activation_scales else {}


def inputs(rank: int, t: int, seed: int, device):
    """hidden [t, H], logical topk_idx [t, K] (distinct per token; expert HOT in column 0 of most tokens, some -1
    slots), topk_weights [t, K]."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    scores = torch.rand(t, E, generator=g)
    scores[:, HOT] += 2.0 * (torch.rand(t, generator=g) < 0.7)
    idx = scores.topk(K, dim=1).indices
    idx[torch.rand(t, K, generator=g) < 0.1] = -1
    w = torch.softmax(torch.randn(t, K, generator=g), dim=1)
    hidden = torch.randn(t, H, generator=g).to(torch.bfloat16)
    return hidden.to(device), idx.to(device), w.to(device)


def rule_slots(emap: moe_ep.ExpertMap, idx: torch.Tensor, rank: int) -> torch.Tensor:
    """docs/eplb.md's replica rule, written apart from the router: slot table[e, (t + k + rank) % count[e]]."""
    idx = idx.cpu()
    t, k = idx.shape
    e = idx.clamp(min=0)
    j = (torch.arange(t).unsqueeze(1) + torch.arange(k).unsqueeze(0) + rank) % emap.replica_count[e]
    return torch.where(idx < 0, -1, emap.replica_table[e, j])


def per_slot(slots: torch.Tensor, num_slots: int) -> list:
    s = slots.cpu().flatten()
    return torch.bincount(s[s >= 0], minlength=num_slots).tolist()


def digest(layer) -> str:
    """A fingerprint of every byte the layer computes with: the oracle's view, and the kernel's own tensors."""
    h = hashlib.sha256()
    qw = layer.oracle_weights()
    for name in qw.tensor_fields():
        h.update(getattr(qw, name).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    for name, t in kernel_tensors(layer).items():
        h.update(name.encode() + t.cpu().numpy().tobytes())
    return h.hexdigest()


def kernel_tensors(layer) -> dict:
    """The tensors a kernel backend hands its kernel, as bytes in storage order (empty for the reference)."""
    front = getattr(layer.backend, "frontend", None)
    kw = getattr(front, "weights", None)
    if kw is None or not is_dataclass(kw):
        return {}
    out = {}
    for f in fields(kw):
        t = getattr(kw, f.name)
        if isinstance(t, torch.Tensor):
            s = t.transpose(1, 2) if t.dim() == 3 else t  # the K-major storage behind the (E, K, N) views
            out[f.name] = s.contiguous().view(torch.uint8).reshape(-1)
    return out


def pointers(layer) -> list:
    qw = layer.oracle_weights() if layer.backend_name == "torch_reference" else None
    ptrs = [getattr(qw, n).data_ptr() for n in qw.tensor_fields()] if qw is not None else []
    front = getattr(layer.backend, "frontend", None)
    kw = getattr(front, "weights", None)
    if kw is not None and is_dataclass(kw):
        ptrs += [getattr(kw, f.name).data_ptr() for f in fields(kw) if isinstance(getattr(kw, f.name), torch.Tensor)]
    return ptrs


def _layer(spec, emap, w13, w2, ctx, backend, fmt, **kw):
    weights = emap.rank_weights(w13, w2, ctx.rank, ctx.world_size, **calibration(fmt))
    return moe_ep.MoELayer(spec, weights, backend=backend, fmt=fmt, device=ctx.device, expert_map=emap, **kw), weights


def tolerance(fmt: str, device) -> float:
    """The oracle's per-token bound; on a GPU an FP8 kernel's worst token may carry an FC2-input element rounded to
    the neighbouring e4m3 value, which at this small I moves it by more (tests/shim/sm90/multirank_gpu_test.py)."""
    return kernel_row_tolerance(fmt, I) if device.type == "cuda" else OUTPUT_TOLERANCE[fmt]


def _checked(layer, weights, hidden, idx, w):
    out = torch.full((hidden.shape[0], H), float("nan"), dtype=torch.bfloat16, device=hidden.device)
    layer(hidden, idx, w, out=out)
    report = check_multirank(layer, hidden, idx, w, out, weights=weights, tol=tolerance(layer.fmt, hidden.device),
                             raise_on_failure=False)
    return out, {"ok": report.ok, "summary": report.summary(), "err": report.mine(layer.ctx.rank).max_row_rel_err}


def _start():
    """What every case starts from: this rank's group, slots per rank and in all, the spec, the logical weights and
    the initial map."""
    ctx = init_from_env()
    s_local = slots_per_rank(ctx.world_size)
    return (ctx, s_local, s_local * ctx.world_size, moe_ep.MoESpec(H, I, E, K, CAPACITY), *logical_weights(),
            initial_map(ctx.world_size))


def scenario(backend: str = "torch_reference", fmt: str = "bf16"):
    """Logical ids through a map, physical ids, the replica rule, counters, swaps (copied from holders, from bf16,
    from quantized weights), a weight update on one replica (the oracle must object) and on all of them."""
    ctx, s_local, num_slots, spec, w13, w2, emap = _start()
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    rec = {"rank": rank, "world": world, "num_slots": num_slots}
    tokens = [37, 5, 48, 0][rank % 4]
    hidden, idx, w = inputs(rank, tokens, seed=1, device=dev)

    layer, weights = _layer(spec, emap, w13, w2, ctx, backend, fmt, check_values=False, collective_checks=False)
    out, rec["logical"] = _checked(layer, weights, hidden, idx, w)
    if E % world == 0:  # a layer with no map over the same logical experts: the model the slotted one reproduces
        with moe_ep.MoELayer(spec, moe_ep.ExpertWeights.from_global(w13, w2, rank, world, **calibration(fmt)),
                             backend=backend, fmt=fmt, device=dev) as plain:
            ok, problems, row, *_ = compare(out, plain(hidden, idx, w), fmt, tolerance(fmt, dev))
        rec["vs_plain"] = {"ok": ok, "err": row, "problems": problems}
    again = layer(hidden, idx, w)
    rec["deterministic"] = bool(torch.equal(again.view(torch.int16), out.view(torch.int16)))

    # Counters: two calls so far, counted by the rule's slots; gathered = every rank's sum.
    expected = per_slot(rule_slots(emap, idx, rank), num_slots)
    local = layer.load_counts()
    rec["counts_local"] = local.cpu().tolist()
    rec["counts_expected"] = [2 * c for c in expected]
    rec["counts_gathered"] = layer.load_counts(reset=True, gather=True).cpu().tolist()
    rec["counts_after_reset"] = layer.load_counts().cpu().tolist()

    # Physical ids: the caller maps (here by the same rule), the layer only counts.
    phys_layer, _ = _layer(spec, emap, w13, w2, ctx, backend, fmt, id_space="physical")
    slots = rule_slots(emap, idx, rank).to(dev)
    pout, rec["physical"] = _checked(phys_layer, weights, hidden, slots, w)
    rec["physical_equals_logical"] = bool(torch.equal(pout.view(torch.int16), out.view(torch.int16)))
    rec["physical_counts"] = phys_layer.load_counts().cpu().tolist()
    rec["physical_counts_expected"] = expected
    phys_layer.close()

    # A captured graph (GPU) replays the map and the counters; it must see the swap below without a recapture.
    graph, gout = None, None
    if dev.type == "cuda":
        gout = torch.empty(tokens, H, dtype=torch.bfloat16, device=dev)
        graph = moe_ep.capture_graph(lambda: layer(hidden, idx, w, out=gout))
        layer.load_counts(reset=True)
        for _ in range(3):
            graph.replay()
        rec["graph_counts"] = layer.load_counts(reset=True).cpu().tolist()
        rec["graph_counts_expected"] = [3 * c for c in expected]

    # Swap 1, weights copied from the slots that hold each expert now.
    before_ptrs = pointers(layer)
    new = swapped_map(emap)
    rec["swap1_written"] = layer.rearrange(new)
    new_weights = new.rank_weights(w13, w2, rank, world, **calibration(fmt))
    out1, rec["swap1"] = _checked(layer, new_weights, hidden, idx, w)
    rec["swap1_close_to_before"] = compare(out1, out, fmt, tolerance(fmt, dev))[0]
    rec["same_addresses"] = pointers(layer) == before_ptrs
    with moe_ep.MoELayer(spec, new_weights, backend=backend, fmt=fmt, device=dev, expert_map=new) as fresh:
        rec["swap1_bytes_equal_fresh"] = digest(layer) == digest(fresh)
    if graph is not None:
        graph.replay()
        eager = layer(hidden, idx, w)
        rec["graph_after_swap_equals_eager"] = bool(torch.equal(gout.view(torch.int16), eager.view(torch.int16)))
        rec["graph_after_swap_hot_slots"] = per_slot(rule_slots(new, idx, rank), num_slots)

    # Swap 2, back: even ranks give bf16 weights for their changed slots, odd ranks copy theirs from holders.
    changed = [s for s in new.changed_slots(emap) if s // s_local == rank]
    src = emap.physical_to_logical[changed]
    given = (w13[src].to(dev), w2[src].to(dev)) if rank % 2 == 0 else None
    rec["swap2_written"] = layer.rearrange(emap, weights=given)
    _, rec["swap2"] = _checked(layer, weights, hidden, idx, w)
    with moe_ep.MoELayer(spec, weights, backend=backend, fmt=fmt, device=dev, expert_map=emap) as fresh:
        rec["swap2_bytes_equal_fresh"] = digest(layer) == digest(fresh)

    # Swap 3: to `new` again, from already-quantized weights (written as they are).
    changed = [s for s in emap.changed_slots(new) if s // s_local == rank]
    src = new.physical_to_logical[changed]
    qw = quantize_weights(fmt, w13[src].to(dev), w2[src].to(dev), **calibration(fmt))
    rec["swap3_written"] = layer.rearrange(new, weights=qw)
    _, rec["swap3"] = _checked(layer, new_weights, hidden, idx, w)
    with moe_ep.MoELayer(spec, new_weights, backend=backend, fmt=fmt, device=dev, expert_map=new) as fresh:
        rec["swap3_bytes_equal_fresh"] = digest(layer) == digest(fresh)

    # A weight update of the hot expert on one of its replicas only: replicas now differ, the oracle must say so.
    g = torch.Generator().manual_seed(77)
    u13 = (torch.randn(1, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16).to(dev)
    u2 = (torch.randn(1, H, I, generator=g) / I ** 0.5).to(torch.bfloat16).to(dev)
    hot_slots = new.slots_of(HOT)
    first = [s - rank * s_local for s in hot_slots[:1] if s // s_local == rank]
    layer.replace_experts(first, (u13, u2) if first else None)
    _, rec["one_replica_updated"] = _checked(layer, None, hidden, idx, w)
    rest = [s - rank * s_local for s in hot_slots[1:] if s // s_local == rank]
    layer.replace_experts(rest, (u13.expand(len(rest), -1, -1).contiguous(), u2.expand(len(rest), -1, -1).contiguous())
                          if rest else None)
    updated = w13.clone(), w2.clone()
    updated[0][HOT], updated[1][HOT] = u13[0].cpu(), u2[0].cpu()
    _, rec["all_replicas_updated"] = _checked(layer, new.rank_weights(*updated, rank, world, **calibration(fmt)),
                                              hidden, idx, w)
    layer.close()
    return rec


def refusals(backend: str = "torch_reference", fmt: str = "bf16", bad_rank: int = 1):
    """Each bad call on one rank: that rank gets its typed error, the others a PeerValidationError naming it (or, for
    maps that differ between ranks, every rank the same ExpertMapError); the layer's bytes and map are unchanged, and
    it serves a checked forward afterwards."""
    ctx, s_local, num_slots, spec, w13, w2, emap = _start()
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    # Every call checked and agreed (not the default schedule's first call only): each refusal below is a later call.
    checks = dict(check_values=True, collective_checks=True)
    layer, weights = _layer(spec, emap, w13, w2, ctx, backend, fmt, **checks)
    hidden, idx, w = inputs(rank, 16, seed=2, device=dev)
    layer(hidden, idx, w)
    counts = layer.load_counts().cpu().tolist()
    before = digest(layer)
    bad = rank == min(bad_rank, world - 1)
    target = emap.reassign({num_slots - 1: HOT})
    mine = [s - rank * s_local for s in emap.changed_slots(target) if s // s_local == rank]
    z = lambda n, *shape, dtype=torch.bfloat16: torch.zeros(n, *shape, dtype=dtype, device=dev)  # noqa: E731
    good_weights = (z(len(mine), 2 * I, H), z(len(mine), H, I))
    other_fmt = "fp8_block" if fmt != "fp8_block" else "bf16"

    def replace(bad_slots, bad_weights):
        """The bad rank's call; the others take part with nothing to write."""
        return lambda: layer.replace_experts(bad_slots, bad_weights) if bad else layer.replace_experts([], None)

    def rearrange(bad_map, bad_weights=None):
        return lambda: layer.rearrange(bad_map, bad_weights) if bad else layer.rearrange(target, good_weights)

    calls = {
        "slot_out_of_range": replace([s_local], (z(1, 2 * I, H), z(1, H, I))),
        "slot_repeated": replace([0, 0], (z(2, 2 * I, H), z(2, H, I))),
        "weights_shape": replace([0], (z(1, 2 * I, H + 128), z(1, H, I))),
        "weights_dtype": replace([0], (z(1, 2 * I, H, dtype=torch.float32), z(1, H, I))),
        "weights_missing": replace([0], None),
        "weights_not_tensors": replace([0], "w13 and w2"),
        "weights_format": replace([0], quantize_weights(other_fmt, z(1, 2 * I, H), z(1, H, I),
                                                        **calibration(other_fmt))),
        "weights_count": rearrange(target, (z(len(mine) + 1, 2 * I, H), z(len(mine) + 1, H, I))),
        "map_wrong_size": rearrange(moe_ep.ExpertMap.round_robin(E, num_slots + world)),
        "map_wrong_experts": rearrange(moe_ep.ExpertMap.round_robin(E + 1, num_slots)),
        "map_not_a_map": rearrange(target.physical_to_logical),
        "forward_logical_id": lambda: layer(hidden, torch.where(idx == idx.max(), E, idx) if bad else idx, w),
    }
    if world > 1:  # every rank's map valid on its own, but not the same
        calls["maps_differ"] = lambda: layer.rearrange(emap.reassign({num_slots - 1: HOT + 1 if bad else HOT}),
                                                       good_weights)
    rec = {"rank": rank, "world": world}
    for name, call in calls.items():
        try:
            call()
            err = None
        except moe_ep.MoEError as e:
            err = error_record(e)
        rec[name] = {"error": err, "unchanged": digest(layer) == before and layer.expert_map == emap}
    # Forward of physical ids on a physical-id layer: a slot id out of range.
    phys, _ = _layer(spec, emap, w13, w2, ctx, backend, fmt, id_space="physical", **checks)
    slots = rule_slots(emap, idx, rank).to(dev)
    phys(hidden, slots, w)  # a good first call: the bad one below is a later one
    if bad:
        slots[0, 0] = num_slots
    try:
        phys(hidden, slots, w)
        rec["forward_slot_id"] = {"error": None}
    except moe_ep.MoEError as e:
        rec["forward_slot_id"] = {"error": error_record(e)}
    phys.close()
    rec["counts_unchanged"] = layer.load_counts().cpu().tolist() == counts
    _, rec["still_serves"] = _checked(layer, weights, hidden, idx, w)
    layer.close()
    return rec


def suite(backend: str = "torch_reference", fmts=("bf16",), bad_rank: int = 1):
    """scenario() for each format, then refusals(), in one set of rank processes (their start-up dominates)."""
    return {"scenario": {f: scenario(backend, f) for f in fmts}, "refusals": refusals(backend, fmts[0], bad_rank)}
