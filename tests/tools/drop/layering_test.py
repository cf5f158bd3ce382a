"""Only shim/ reaches the kernel trees; moe_ep/core reaches neither; nothing holds both trees.

The first test runs the check over this checkout; the others plant one
violation each in a synthetic repo and expect exactly that violation.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.tools.drop import synthetic
from tools.drop.layering import check_layering
from tools.drop.trees import find_repo_root


def _repo_root() -> Path:
    # Under Bazel this file is a runfiles symlink to the checkout (the test is
    # tagged local + external: it reads the live tree and is never cached).
    return find_repo_root(Path(__file__).resolve().parent)


def test_this_checkout_is_layered():
    root = _repo_root()
    assert (root / "tools" / "drop" / "layering.py").is_file(), root
    violations = check_layering(root)
    assert violations == [], "layering violations:\n" + "\n".join(map(str, violations))


def _repo(tmp_path: Path, files: dict) -> Path:
    base = {
        "shim/__init__.py": "",
        "shim/sm90/__init__.py": "",
        "shim/sm90/kernel_symbols.py": "from moe_hopper_fp8.heuristic_config import TABLE\nimport src.sym_buffer\n",
        "shim/sm100/__init__.py": "",
        "shim/sm100/kernel_symbols.py": "from moe_mxfp8_glu.megamoe_kernel_mxfp8 import K\n",
        "shim/common/tree.py": "import sys, os\nsys.path.insert(0, os.environ['MOE_EP_SM90_TREE'])\nfrom src import bootstrap\n",
        "moe_ep/__init__.py": "",
        "moe_ep/core/__init__.py": "from . import registry\n",
        "moe_ep/core/registry.py": "import importlib\n",
        "moe_ep/backends/sm90_fp8.py": "def load():\n    from shim.sm90 import kernel_symbols\n",
        "tests/t_test.py": "import moe_ep\n",
    }
    base.update({k: textwrap.dedent(v) for k, v in files.items()})
    return synthetic.write_tree(tmp_path / "repo", base)


def _found(repo: Path):
    return [(v.file, v.line, v.rule) for v in check_layering(repo)]


def test_synthetic_baseline_is_clean(tmp_path):
    assert _found(_repo(tmp_path, {})) == []


@pytest.mark.parametrize(
    "files, expected",
    [
        # kernel import outside shim/, in each form
        ({"moe_ep/backends/x.py": "from moe_hopper_fp8 import megamoe_kernel_fp8\n"},
         [("moe_ep/backends/x.py", 1, "kernel-import")]),
        ({"tests/k_test.py": "import os\nimport common.host_utils\n"},
         [("tests/k_test.py", 2, "kernel-import")]),
        ({"tools/x.py": "import importlib\nm = importlib.import_module('src.bootstrap')\n"},
         [("tools/x.py", 2, "kernel-import")]),
        ({"tools/y.py": "import sys\nsys.path.insert(0, '/x/kernel_src/sm90/pull_style_cutedsl_megakernel/src')\n"},
         [("tools/y.py", 2, "kernel-path")]),
        # moe_ep/core must not import the shim, even lazily
        ({"moe_ep/core/plan.py": "def f():\n    import shim.sm90.knobs\n"},
         [("moe_ep/core/plan.py", 2, "core-imports-shim")]),
        # one module, both trees
        ({"moe_ep/backends/both.py": "from shim.sm90 import knobs\nfrom shim.sm100 import knobs as k2\n"},
         [("moe_ep/backends/both.py", 1, "both-trees")]),
        # the sm90 shim reaching the Blackwell tree
        ({"shim/sm90/bad.py": "from moe_mxfp8_glu import kernel_mxfp8_glu_fc12\n"},
         [("shim/sm90/bad.py", 1, "cross-tree")]),
        ({"shim/sm90/bad.py": "from ..sm100 import kernel_symbols\n"},
         [("shim/sm90/bad.py", 1, "cross-tree")]),
        # tree-agnostic shim/common naming a tree-specific package
        ({"shim/common/bad.py": "import moe_hopper_fp8.heuristic_config\n"},
         [("shim/common/bad.py", 1, "common-tree-specific")]),
        # a repo package shadowing a kernel top-level name
        ({"src/__init__.py": ""}, [("src", 0, "shadow")]),
    ],
)
def test_each_violation_is_reported(tmp_path, files, expected):
    assert _found(_repo(tmp_path, files)) == expected


def test_strings_and_similar_names_are_not_imports(tmp_path):
    repo = _repo(tmp_path, {
        "tools/doc.py": "TEXT = 'from moe_hopper_fp8 import x'\nimport commonmark_like as common_x\n",
        "moe_ep/core/names.py": "from moe_ep.core import registry\nshim_name = 'shim.sm90'\n",
    })
    assert _found(repo) == []


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
