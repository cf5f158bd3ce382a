"""The format tables (shim/<arch>/formats.py) are the one statement of each kernel backend: moe_ep's registry, the
backend classes, the frontends, the knobs and the kernel symbols agree with them; availability follows the tree's
contents; a table imports nothing heavy.

Arches: all, or those in $MOE_EP_FORMAT_ARCHES (Bazel runs one target per arch: no target may depend on both
trees).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import moe_ep
from moe_ep.core import registry

ROOT = Path(__file__).resolve().parents[3]
ARCHES = [a.strip() for a in os.environ.get("MOE_EP_FORMAT_ARCHES", "sm90,sm100").split(",") if a.strip()]


def _table(arch):
    import importlib

    return importlib.import_module(f"shim.{arch}.formats").BACKENDS


def _lazy_symbols(arch):
    """kernel_symbols' _LAZY table, read by AST (importing it would activate the tree)."""
    tree = ast.parse((ROOT / "shim" / arch / "kernel_symbols.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"shim/{arch}/kernel_symbols.py has no _LAZY table")


@pytest.mark.parametrize("arch", ARCHES)
def test_the_registry_the_backends_and_the_table_agree(arch):
    table = _table(arch)
    backend_module = __import__(f"shim.{arch}.backend", fromlist=["__all__"])
    knobs = __import__(f"shim.{arch}.knobs", fromlist=["KNOB_SPACE"])
    lazy = _lazy_symbols(arch)
    listed = [name for name, info in moe_ep.list_backends().items() if info.arch == arch]
    assert listed == [row.backend for row in table], "registry order is table order (an arch's first row is its default)"
    for row in table:
        entry = registry.get_entry(row.backend)
        assert (entry.target, entry.arch, entry.formats, entry.description) == (
            row.target, arch, (row.fmt,), row.description)
        cls = registry.resolve_backend(row.backend)
        assert cls is getattr(backend_module, row.target.split(":")[1])
        assert (cls.name, cls.arch, cls.row, cls.weight_formats, cls.table) == (
            row.backend, arch, row, (row.fmt,), table)
        assert issubclass(cls, moe_ep.Backend)
        fe = cls.frontend_class()
        assert (fe.arch, fe.fmt) == (arch, row.fmt) and f"{fe.__module__}:{fe.__name__}" == row.frontend
        # The knobs draw from the row's kernel class; the kernel symbols export every class of the row from the
        # module the row names (the one availability looks for).
        assert knobs.KERNEL_CLASS[row.fmt] == row.knob_space and row.knob_space in knobs.KNOB_SPACE
        for name in row.kernel_classes:
            assert lazy.get(name) == (row.kernel_module, name), (row.backend, name)
    assert select_default(arch) == table.rows[0].backend


@pytest.mark.parametrize("arch", ARCHES)
def test_the_arch_classes_fill_in_hooks_only(arch):
    """The shipped arch and format classes define no composer (they would not import otherwise); every backend class
    the arch module writes out is its arch class bound to one row, one per row; every frontend is one class on its
    arch's (arch -> format, nothing between) with its own weight layout."""
    from shim.common.frontend import MegaMoEFrontend
    from shim.common.weights import KernelWeights

    table = _table(arch)
    backend_module = __import__(f"shim.{arch}.backend", fromlist=["__all__"])
    arch_cls = getattr(backend_module, f"{arch.capitalize()}Backend")
    classes = [getattr(backend_module, n) for n in backend_module.__all__ if n != arch_cls.__name__]
    assert sorted(c.row.backend for c in classes) == sorted(row.backend for row in table)
    assert all(c.__bases__ == (arch_cls,) and c.name == c.row.backend for c in classes)
    for row in table:
        fe = row.frontend_class()
        assert issubclass(fe, MegaMoEFrontend) and fe.table is table
        assert fe.__mro__[2] is MegaMoEFrontend, f"{fe.__name__} sits {fe.__mro__.index(MegaMoEFrontend) - 1} deep"
        assert issubclass(fe.weights_layout, KernelWeights) and fe.weights_layout.fmt == row.fmt


@pytest.mark.parametrize("arch", ARCHES)
def test_a_backend_class_names_its_own_row(arch):
    """A class bound to a row whose target names another class is refused when it is defined."""
    backend_module = __import__(f"shim.{arch}.backend", fromlist=["__all__"])
    arch_cls = getattr(backend_module, f"{arch.capitalize()}Backend")
    fmt = _table(arch).rows[0].fmt
    with pytest.raises(ValueError, match="targets"):
        type("Impostor", (arch_cls,), {"__module__": backend_module.__name__}, fmt=fmt)


def select_default(arch):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return registry.select_backend(arch).name


def test_a_table_imports_no_kernel_no_cutlass_no_torch():
    code = textwrap.dedent("""
        import sys
        import shim.sm90.formats, shim.sm100.formats
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cutlass", "common", "src",
                       "moe_hopper_fp8", "moe_hopper_bf16", "moe_nvfp4_swapab", "moe_mxfp8_glu", "moe_bf16_glu"))
        assert not heavy, heavy
        print("CLEAN", len(shim.sm90.formats.BACKENDS) + len(shim.sm100.formats.BACKENDS))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    assert proc.returncode == 0 and "CLEAN" in proc.stdout, proc.stdout + proc.stderr


def test_size_rules_name_the_argument_and_the_kernel():
    from shim.common.formats import KernelFormat

    row = KernelFormat(backend="b", arch="sm90", fmt="bf16", description="", hidden_multiple=64,
                       intermediate_multiple=128, kernel_module="m.k", kernel_classes=("K",), frontend="a:B",
                       target="a:C")
    assert row.size_violations(hidden=128, intermediate=256, top_k=8) == []
    problems = dict(row.size_violations(hidden=96, intermediate=64, top_k=33))
    assert set(problems) == {"hidden_size", "intermediate_size", "top_k"}
    assert "multiple of 64 for the sm90 bf16 kernel, got 96" in problems["hidden_size"]
    assert "[1, 32]" in problems["top_k"]


def test_a_table_refuses_two_rows_for_one_format():
    from shim.common.formats import FormatTable

    row = _table("sm90").rows[0]
    other = type(row)(**{**row.__dict__, "backend": "x", "target": "shim.sm90.backend:X"})
    with pytest.raises(ValueError, match="repeats a fmt"):
        FormatTable("sm90", (row, other), cute_targets=("sm_90",))
    with pytest.raises(ValueError, match="names arch"):
        FormatTable("sm100", (row,), cute_targets=("sm_100",))


def _fake_sm90_tree(root: Path) -> Path:
    """An sm90 tree as an older drop (0.7.2.post1) has it: the FP8 kernel, no moe_hopper_bf16 package."""
    for rel in ("common/__init__.py", "src/__init__.py", "moe_hopper_fp8/__init__.py",
                "moe_hopper_fp8/megamoe_kernel_fp8.py", "moe_nvfp4_swapab/__init__.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("# stand-in\n")
    return root


def test_availability_follows_the_trees_contents(tmp_path):
    """On a tree without moe_hopper_bf16, list_backends() says sm90_bf16_cutedsl is unavailable and why, and a
    layer asking for it is refused with a typed error naming the missing module, before anything is imported."""
    tree = _fake_sm90_tree(tmp_path / "src")
    code = textwrap.dedent("""
        import json, sys
        import torch
        import moe_ep
        from tests.support.dist import one_rank_gloo_group

        info = moe_ep.list_backends()
        out = {name: [info[name].available, info[name].reason] for name in ("sm90_fp8_cutedsl", "sm90_bf16_cutedsl")}
        spec = moe_ep.MoESpec(hidden_size=128, intermediate_size=128, num_experts=4, top_k=2, max_tokens_per_rank=8)
        w = moe_ep.ExpertWeights(torch.zeros(4, 256, 128, dtype=torch.bfloat16),
                                 torch.zeros(4, 128, 128, dtype=torch.bfloat16), rank=0, world_size=1, num_experts=4)
        import moe_ep.layer
        moe_ep.layer.require_arch = lambda *a, **k: None  # as on a Hopper host: the layer's arch guard passes
        with one_rank_gloo_group():
            try:
                moe_ep.MoELayer(spec, w, backend="sm90_bf16_cutedsl")
            except moe_ep.BackendUnavailableError as e:
                out["layer"] = [type(e).__name__, e.argument, str(e)]
        out["imported"] = sorted(m for m in sys.modules if m.split(".")[0] in ("cutlass", "moe_hopper_fp8")
                                 or m.startswith(("shim.sm90.backend", "shim.sm90.bf16_frontend")))
        print(json.dumps(out))
    """)
    env = dict(os.environ, MOE_EP_SM90_TREE=str(tree), MOE_EP_UNPINNED_TREE="sm90", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sm90_fp8_cutedsl"] == [True, ""]
    available, reason = out["sm90_bf16_cutedsl"]
    assert not available and "moe_hopper_bf16.megamoe_kernel_bf16" in reason and str(tree) in reason
    kind, argument, message = out["layer"]
    assert kind == "BackendUnavailableError" and argument == "backend"
    assert "moe_hopper_bf16.megamoe_kernel_bf16" in message
    assert out["imported"] == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
