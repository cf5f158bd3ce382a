"""The shim model: registry literal, per-format reach through format-keyed tables and guards."""

from __future__ import annotations

import textwrap

import pytest

from tests.tools.drop import synthetic
from tools.drop.callsites import ShimModel, read_registry

FACTORY = textwrap.dedent(
    """
    from shim.sm100.nv_frontend import NvFrontend
    from shim.sm100.mx_frontend import MxFrontend

    FRONTENDS = {"nvfp4": NvFrontend, "mxfp8": MxFrontend}


    def make_frontend(fmt):
        return FRONTENDS[fmt]()


    class Backend:
        def make(self):
            return make_frontend(self.fmt)
    """
)


@pytest.fixture
def repo(tmp_path):
    return synthetic.write_tree(tmp_path / "repo", {
        "shim/__init__.py": "", "shim/sm100/__init__.py": "",
        "shim/sm100/backend.py": FACTORY,
        "shim/sm100/nv_frontend.py": "from shim.sm100 import ks\n\nclass NvFrontend:\n    def k(self):\n        return ks.NvKernel\n",
        "shim/sm100/mx_frontend.py": "from shim.sm100 import ks\n\nclass MxFrontend:\n    def k(self):\n        return ks.MxKernel\n",
        "shim/sm100/ks.py": '_LAZY = {"NvKernel": ("moe_nv.k", "NvKernel"), "MxKernel": ("moe_mx.k", "MxKernel")}\n',
        "moe_ep/core/registry.py": textwrap.dedent(
            """
            register_backend("nv", "shim.sm100.backend:Backend", arch="sm100", formats=("nvfp4",))
            register_backend("mx", "shim.sm100.backend:Backend", arch="sm100", formats=("mxfp8",))
            register_backend("computed", NAME, arch="sm100", formats=("bf16",))  # not a literal: skipped
            """
        ),
    })


def test_registry_literal(repo):
    assert [(b.name, b.module, b.attr, b.arch, b.formats) for b in read_registry(repo)] == [
        ("nv", "shim.sm100.backend", "Backend", "sm100", ("nvfp4",)),
        ("mx", "shim.sm100.backend", "Backend", "sm100", ("mxfp8",)),
    ]


def test_format_keyed_table_splits_one_backend_class_by_format(repo):
    model = ShimModel(repo, "sm100", {"moe_nv", "moe_mx"})
    uses = {u.name: model.hits(u.site) for u in model.kernel_uses()}
    assert uses == {"NvKernel": {("nv", "nvfp4")}, "MxKernel": {("mx", "mxfp8")}}
    # Naming a class in a module-level table does not run it: only the backend that picks it does.
    assert "shim.sm100.mx_frontend:MxFrontend" not in model.reach(("nv", "nvfp4"))
    assert "shim.sm100.mx_frontend:" in model.reach(("nv", "nvfp4"))  # its module is imported, though


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
