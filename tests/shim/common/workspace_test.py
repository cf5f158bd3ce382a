"""The shared workspace on CPU (compile-only pools: plain host memory, the same bookkeeping as on a GPU): one
staging arena sized by the largest layer, kernel workspaces shared by layout, growth that invalidates old
views, refusal before any allocation, and release that leaves nothing behind."""
import pytest
import torch

import moe_ep
from moe_ep.core.dist import RankContext
from shim.common import workspace
from shim.common.workspace import BufferSpec, WorkspaceError, WorkspacePool


def _staging(c, h=256, k=4):
    return [BufferSpec("act", (c, h), torch.float8_e4m3fn, True), BufferSpec("act_sf", (c, h // 128), torch.float32, True),
            BufferSpec("topk_w", (c, k), torch.float32, True), BufferSpec("topk_idx", (c, k), torch.int64, False),
            BufferSpec("out_buf", (c, h), torch.bfloat16, False)]


@pytest.fixture
def pool():
    return WorkspacePool(RankContext.detached(rank=0, world_size=1), "sm90", compile_only=True)


def test_layers_of_one_layout_share_everything(pool):
    a = pool.acquire(1, _staging(64), "layout-A", (1000, 5000))
    b = pool.acquire(2, _staging(64), "layout-A", (1000, 5000))
    va, vb = a.views(), b.views()
    for name in ("act", "act_sf", "topk_w", "topk_idx", "out_buf", "local_ws", "shared_ws"):
        assert va[name].data_ptr() == vb[name].data_ptr(), name
    assert va["local_ws"].numel() == 1000 and va["shared_ws"].numel() == 5000
    st = pool.stats()
    assert st["layers"] == 2 and st["kernel_layouts"] == 1 and st["kernel_shared"] == 5000
    # Buffers of one layer never overlap each other.
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for n, t in va.items() if n in ("act", "act_sf", "topk_w"))
    assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))


def test_another_layout_gets_its_own_kernel_workspaces_but_the_same_staging(pool):
    a = pool.acquire(1, _staging(64), "layout-A", (1000, 5000))
    b = pool.acquire(2, _staging(32, h=512), "layout-B", (200, 700))
    va, vb = a.views(), b.views()
    assert va["shared_ws"].data_ptr() != vb["shared_ws"].data_ptr()
    assert va["act"].data_ptr() == vb["act"].data_ptr()  # both stage into the one arena
    assert pool.stats()["kernel_layouts"] == 2


def test_a_larger_layer_grows_the_arena_and_old_views_go_stale(pool):
    a = pool.acquire(1, _staging(16), "layout-A", (100, 100))
    va = a.views()
    size = pool.stats()["symmetric_staging"]
    assert not a.stale
    b = pool.acquire(2, _staging(4096), "layout-B", (100, 100))
    assert pool.stats()["symmetric_staging"] > size and a.stale
    va2, vb = a.views(), b.views()
    assert not a.stale and va2["act"].data_ptr() == vb["act"].data_ptr()
    assert va2["act"].shape == va["act"].shape  # a layer keeps its own shapes, in the larger arena
    # A smaller layer afterwards does not grow anything.
    gen = pool.generation
    pool.acquire(3, _staging(8), "layout-A", (100, 100))
    assert pool.generation == gen


def test_release_frees_what_no_layer_uses(pool):
    leases = [pool.acquire(i, _staging(64), "A" if i < 2 else "B", (10, 10)) for i in range(3)]
    leases[2].release()
    assert pool.stats()["kernel_layouts"] == 1 and pool.stats()["layers"] == 2
    leases[0].release()
    leases[1].release()
    st = pool.stats()
    assert st == dict(st, layers=0, kernel_layouts=0, symmetric_staging=0, local_staging=0, kernel_shared=0,
                      kernel_local=0)
    leases[1].release()  # twice is harmless


def test_a_layer_that_does_not_fit_is_refused_before_anything_is_allocated(monkeypatch):
    pool = WorkspacePool(RankContext.detached(rank=0, world_size=1, device="cpu"), "sm90", compile_only=False)
    pool.device = torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 80 << 30))
    allocated = []
    monkeypatch.setattr(pool, "_heap_alloc", lambda n: allocated.append(n) or torch.zeros(n, dtype=torch.uint8))
    monkeypatch.setattr(pool, "_local_alloc", lambda n: allocated.append(n) or torch.zeros(n, dtype=torch.uint8))
    with pytest.raises(WorkspaceError) as err:
        pool.acquire(1, _staging(64), "A", (1 << 29, 1 << 30))  # 1.5 GiB of workspaces, 1 GiB free
    assert isinstance(err.value, moe_ep.MoEError) and err.value.argument == "max_tokens_per_rank"
    assert "GiB" in str(err.value) and not allocated and pool.stats()["layers"] == 0


def test_pools_are_one_per_group_device_and_tree():
    ctx = RankContext.detached(rank=0, world_size=2)
    assert workspace.pool_for(ctx, "sm90", True) is workspace.pool_for(RankContext.detached(0, 2), "sm90", True)
    assert workspace.pool_for(ctx, "sm90", True) is not workspace.pool_for(RankContext.detached(1, 2), "sm90", True)
    assert workspace.pool_for(ctx, "sm90", True) is not workspace.pool_for(ctx, "sm100", True)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
