"""`import moe_ep` works on a host with no GPU and pulls in no kernel tree; moe_ep/core names none."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import moe_ep

ROOT = Path(moe_ep.__file__).resolve().parent
# The drop's top-level packages and the kernel toolchain ("cuda" is left out: torch itself imports
# cuda-bindings).
KERNEL_TOP_LEVEL = {"cutlass", "nvshmem", "shim", "common", "src", "moe_hopper_fp8", "moe_hopper_bf16",
                    "moe_nvfp4_swapab", "moe_bf16_glu", "moe_mxfp8_glu", "moe_mxfp8_bf16_glu", "triton"}


def test_import_in_a_fresh_cpu_only_process():
    code = ("import json, sys, moe_ep; "
            "print(json.dumps({'mods': sorted(sys.modules), 'all': moe_ep.__all__, "
            "'backends': {k: list(v) for k, v in moe_ep.list_backends().items()}}))")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p])
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout.strip().splitlines()[-1])
    loaded = {m.split(".")[0] for m in data["mods"]}
    assert not (loaded & KERNEL_TOP_LEVEL), sorted(loaded & KERNEL_TOP_LEVEL)
    assert not [m for m in data["mods"] if m.startswith("shim")]
    assert "torch_reference" in data["backends"]
    for name in data["all"]:
        assert hasattr(moe_ep, name), name


def test_all_is_explicit_and_complete():
    assert len(moe_ep.__all__) == len(set(moe_ep.__all__))
    submodules = ("checkpoint", "core", "eplb", "errors", "formats", "integrations", "layer", "module", "reference",
                  "split", "testing")
    public = {n for n in vars(moe_ep) if not n.startswith("_") and n not in submodules}
    assert public == set(moe_ep.__all__)


def _imports(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


@pytest.mark.parametrize("sub", ["core", "eplb", "formats", "reference", "split", "testing", "integrations"])
def test_runtime_sources_name_no_kernel_tree_and_no_shim(sub):
    """The ground floor imports nothing above it: no kernel tree, no shim (the registry names the kernel backends
    by lazy strings only)."""
    offenders = []
    for path in sorted((ROOT / sub).rglob("*.py")):
        for mod in _imports(path):
            if mod.split(".")[0] in KERNEL_TOP_LEVEL:
                offenders.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not offenders, offenders


def test_formats_is_a_leaf():
    """The format contract builds on moe_ep's errors only: the shim's staging and the reference both import it,
    and it imports neither (nor the oracle)."""
    offenders = []
    for path in sorted((ROOT / "formats").rglob("*.py")):
        for mod in _imports(path):
            if mod.startswith("moe_ep.") and not mod.startswith(("moe_ep.formats", "moe_ep.errors")):
                offenders.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not offenders, offenders


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
