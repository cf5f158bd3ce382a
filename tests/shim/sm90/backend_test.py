"""The Hopper backends added for #22 as moe_ep sees them on a CPU host: registered under their names, per-tensor
FP8 refused without calibration, no Hopper kernel backend for W4A8 NVFP4 (its kernel is in no pinned tree), and
W4A8 MXFP4 refused naming the module when the tree lacks it (a tree like drop 0.7.2.post1's, built here from the pinned one minus
that module; run in a child process: one process holds one tree)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import moe_ep
from moe_ep.core import registry
from tests.support.dist import one_rank_gloo_group

pytestmark = pytest.mark.usefixtures("sm90_tree")

BACKENDS = {
    "sm90_fp8_tensor_cutedsl": ("Sm90Fp8TensorBackend", "fp8_tensor"),
    "sm90_w4a8_mxfp4_cutedsl": ("Sm90W4A8Mxfp4Backend", "w4a8_mxfp4"),
}
MXFP4_MODULE = "moe_hopper_fp8.kernel_mxfp4_fp8_glu_fc12_swapab"


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_registered_and_resolvable(name):
    attr, fmt = BACKENDS[name]
    entry = registry.get_entry(name)
    assert entry.target == f"shim.sm90.backend:{attr}" and entry.arch == "sm90" and entry.formats == (fmt,)
    cls = registry.resolve_backend(name)
    assert cls.__name__ == attr and cls.name == name and cls.weight_formats == (fmt,)
    assert registry.select_backend("sm90", fmt).name == name


def test_availability_on_the_pinned_tree():
    info = moe_ep.list_backends()
    assert info["sm90_fp8_tensor_cutedsl"] == ("sm90", ("fp8_tensor",), True)
    assert info["sm90_w4a8_mxfp4_cutedsl"] == ("sm90", ("w4a8_mxfp4",), True)
    from shim.sm90.formats import BACKENDS

    assert MXFP4_MODULE in BACKENDS.row("w4a8_mxfp4").requires


@pytest.fixture(scope="module")
def gloo_group():
    with one_rank_gloo_group():
        yield


@pytest.fixture
def as_if_hopper(monkeypatch):
    """The layer's device check passed, as on a Hopper host: what comes after it is under test here."""
    import moe_ep.layer

    monkeypatch.setattr(moe_ep.layer, "require_arch", lambda *a, **k: None)


def _weights(**cal):
    return moe_ep.ExpertWeights(torch.zeros(4, 256, 256, dtype=torch.bfloat16),
                                torch.zeros(4, 256, 128, dtype=torch.bfloat16), rank=0, world_size=1, num_experts=4,
                                **cal)


def test_per_tensor_fp8_without_calibration_is_refused(gloo_group, as_if_hopper):
    spec = moe_ep.MoESpec(hidden_size=256, intermediate_size=128, num_experts=4, top_k=2, max_tokens_per_rank=16)
    with pytest.raises(moe_ep.CalibrationError) as err:
        moe_ep.MoELayer(spec, _weights(act_amax=2.0), backend="sm90_fp8_tensor_cutedsl")
    assert err.value.argument == "weights.fc2_act_amax"


def test_w4a8_nvfp4_has_no_hopper_kernel_backend():
    """Its kernel is in no pinned tree: no sm90 backend serves the format, only the torch reference (the registry
    says so, with a warning, when a layer on Hopper asks for it without naming a backend)."""
    assert not [n for n, b in moe_ep.list_backends().items() if "w4a8_nvfp4" in b.formats and b.arch == "sm90"]
    with pytest.warns(RuntimeWarning, match="w4a8_nvfp4"):
        assert registry.select_backend("sm90", "w4a8_nvfp4").name == "torch_reference"


def _tree_without(root: str, missing: str, dest: str) -> None:
    """`dest`: symlinks to everything in `root` except the file of module `missing`."""
    miss = os.path.join(root, *missing.split(".")) + ".py"
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        os.makedirs(os.path.join(dest, rel), exist_ok=True)
        for f in filenames:
            src = os.path.join(dirpath, f)
            if src != miss:
                os.symlink(src, os.path.join(dest, rel, f))


def test_a_tree_without_the_w4a8_kernel_refuses_the_layer_naming_the_module(tmp_path):
    """The pinned tree minus the W4A8 module (as drop 0.7.2.post1 has it): list_backends() says the W4A8 backend is
    unavailable and why, per-tensor FP8 stays available, and a layer asking for W4A8 on a Hopper host (its device
    check stood in for) is refused naming the module, before any W4A8 module is imported."""
    from shim.common import tree

    old = tmp_path / "sm90_without_mxfp4"
    _tree_without(tree.locate("sm90"), MXFP4_MODULE, str(old))
    code = textwrap.dedent("""
        import json, sys, warnings
        warnings.simplefilter("ignore")
        import torch
        import moe_ep
        import moe_ep.layer
        from tests.support.dist import one_rank_gloo_group
        moe_ep.layer.require_arch = lambda *a, **k: None  # as on a Hopper host (the device check passed)
        info = moe_ep.list_backends()
        out = {n: [info[n].available, info[n].reason] for n in ("sm90_fp8_tensor_cutedsl", "sm90_w4a8_mxfp4_cutedsl")}
        spec = moe_ep.MoESpec(hidden_size=256, intermediate_size=128, num_experts=4, top_k=2, max_tokens_per_rank=16)
        w = moe_ep.ExpertWeights(torch.zeros(4, 256, 256, dtype=torch.bfloat16),
                                 torch.zeros(4, 256, 128, dtype=torch.bfloat16), rank=0, world_size=1, num_experts=4)
        with one_rank_gloo_group():
            try:
                moe_ep.MoELayer(spec, w, backend="sm90_w4a8_mxfp4_cutedsl")
            except moe_ep.BackendUnavailableError as e:
                out["layer"] = [e.argument, str(e)]
        # moe_ep's own format module (moe_ep.formats.w4a8_mxfp4) is part of `import moe_ep`; no shim or kernel one.
        out["loaded"] = sorted(m for m in sys.modules if "mxfp4" in m and not m.startswith("moe_ep."))
        print(json.dumps(out))
    """)
    # This process's path without the pinned tree (one tree per process: the child loads the other one).
    env = dict(os.environ, MOE_EP_SM90_TREE=str(old), MOE_EP_UNPINNED_TREE="sm90", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in sys.path
                                          if p and not os.path.isdir(os.path.join(p, "moe_hopper_fp8"))))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sm90_fp8_tensor_cutedsl"] == [True, ""]  # per-tensor FP8 needs nothing newer
    available, reason = out["sm90_w4a8_mxfp4_cutedsl"]
    assert not available and MXFP4_MODULE in reason and str(old) in reason
    argument, message = out["layer"]
    assert argument == "backend" and MXFP4_MODULE in message
    assert out["loaded"] == []  # refused before anything imported a W4A8 module


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
