"""Only shim/ reaches the kernel trees; moe_ep/core reaches neither; nothing holds both trees.

The first test runs the check over this checkout; the others plant one
violation each in a synthetic repo and expect exactly that violation. Among them
the two bypasses of issue #14, which the check used to pass: a computed import of
a kernel module from moe_ep, and a slice assignment to sys.path followed by an
import of a kernel module by its bare name.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.tools.drop import synthetic
from tools.drop import layering
from tools.drop.layering import check_layering
from tools.drop.trees import find_repo_root


def _repo_root() -> Path:
    # Under Bazel this file is a runfiles symlink to the checkout (the test is
    # tagged local: it reads the live tree; the source digest in its data reruns it
    # when that changes).
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
        "moe_ep/core/registry.py": "import importlib\nTARGET = 'shim.sm90.backend:Sm90Fp8Backend'\n",
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
        # moe_ep, the ground floor, imports neither shim nor tools, even lazily (#26: moe_ep/testing did)
        ({"moe_ep/core/plan.py": "def f():\n    import shim.sm90.knobs\n"},
         [("moe_ep/core/plan.py", 2, "moe_ep-imports-upper")]),
        ({"moe_ep/testing/helpers.py": "def f():\n    from shim.sm90 import knobs\n"},
         [("moe_ep/testing/helpers.py", 2, "moe_ep-imports-upper")]),
        ({"moe_ep/reference/x.py": "from tools.launch import launcher\n"},
         [("moe_ep/reference/x.py", 1, "moe_ep-imports-upper")]),
        # one module, both trees
        ({"tools/both.py": "from shim.sm90 import knobs\nfrom shim.sm100 import knobs as k2\n"},
         [("tools/both.py", 1, "both-trees")]),
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


# The two bypasses of issue #14: both passed the layering check, the query test and the visibility test.
ISSUE_14_BYPASSES = [
    ({"moe_ep/backends/x.py": "import importlib\n"
                              "k = importlib.import_module('moe_hopper' + '_fp8.megamoe_kernel_fp8')\n"},
     [("moe_ep/backends/x.py", 2, "kernel-import")]),  # the concatenation folded: the kernel module it names
    ({"moe_ep/backends/y.py": "import os, sys\n"
                              "sys.path[:0] = [os.path.join(os.environ['TREE'], 'moe_hopper_fp8')]\n"
                              "import megamoe_kernel_fp8\n"},
     [("moe_ep/backends/y.py", 2, "sys-path")]),
]


@pytest.mark.parametrize("files, expected", ISSUE_14_BYPASSES)
def test_issue_14_bypasses_fail_the_check(tmp_path, files, expected):
    assert _found(_repo(tmp_path, files)) == expected


@pytest.mark.parametrize(
    "source, rule",
    [
        # computed module names, in each form
        ("import importlib\nm = importlib.import_module(f'moe_{kind}_fp8')\n", "computed-import"),
        ("name = input()\nm = __import__(name)\n", "computed-import"),
        ("from importlib import import_module\nm = import_module('%s.x' % pkg)\n", "computed-import"),
        ("import importlib.util\nok = importlib.util.find_spec(pkg + '.heuristic_config')\n", "computed-import"),
        ("import runpy\nrunpy.run_module(name)\n", "computed-import"),
        ("import runpy\nrunpy.run_path(path)\n", "computed-import"),
        ("import importlib.util as u\nspec = u.spec_from_file_location('k', path)\n", "computed-import"),
        ("from importlib.machinery import SourceFileLoader\nm = SourceFileLoader('k', p).load_module()\n",
         "computed-import"),
        ("exec(code)\n", "computed-import"),
        ("x = eval('__import__(' + repr(n) + ')')\n", "computed-import"),
        # literal forms that name a kernel module
        ("exec('import moe_hopper_fp8.megamoe_kernel_fp8')\n", "kernel-import"),
        ("import importlib.util\nok = importlib.util.find_spec('moe_mxfp8_glu')\n", "kernel-import"),
        ("import runpy\nrunpy.run_module('src.bootstrap')\n", "kernel-import"),
        ("import importlib.util\ns = importlib.util.spec_from_file_location('k', "
         "'/x/cutedsl_megamoe_sm90/moe_hopper_fp8/k.py')\n", "kernel-path"),
        ("register_backend('x', 'moe_hopper_fp8.megamoe_kernel_fp8:Sm90MegaMoEFp8Kernel')\n", "kernel-target"),
        # sys.path changes, in each form
        ("import sys\nsys.path.append(d)\n", "sys-path"),
        ("import sys\nsys.path.extend([d])\n", "sys-path"),
        ("import sys\nsys.path = [d] + sys.path\n", "sys-path"),
        ("import sys\nsys.path += [d]\n", "sys-path"),
        ("import sys\nsys.path[0:0] = [d]\n", "sys-path"),
        ("import sys\ndel sys.path[0]\n", "sys-path"),
        ("import sys\np = sys.path\np.insert(0, d)\n", "sys-path"),
        ("from sys import path\npath[:0] = [d]\n", "sys-path"),
        ("from sys import path as p\np += [d]\n", "sys-path"),
        ("import sys as s\ns.path.insert(0, d)\n", "sys-path"),
        ("import sys\nsetattr(sys, 'path', [d])\n", "sys-path"),
        ("import sys\ngetattr(sys, 'path').insert(0, d)\n", "sys-path"),
        ("import sys\nsys.__dict__['path'].append(d)\n", "sys-path"),
        ("import site\nsite.addsitedir(d)\n", "sys-path"),
        ("import os, sys\nsys.path.insert(0, os.environ['MOE_EP_SM90_TREE'])\n", "kernel-path"),
        # PYTHONPATH written for a child, outside tools/launch
        ("import os\nos.environ['PYTHONPATH'] = d\n", "pythonpath"),
        ("import os\nenv = dict(os.environ, PYTHONPATH=d)\n", "pythonpath"),
        ("import os, sys\nenv = dict(os.environ, PYTHONPATH=os.pathsep.join([d] + sys.path))\n", "pythonpath"),
        ("env.update({'PYTHONPATH': d})\n", "pythonpath"),
        ("import os\nos.putenv('PYTHONPATH', d)\n", "pythonpath"),
    ],
)
def test_each_bypass_form_is_reported(tmp_path, source, rule):
    found = _found(_repo(tmp_path, {"moe_ep/core/x.py": source}))
    assert [r for _, _, r in found] == [rule], found
    assert found[0][0] == "moe_ep/core/x.py"


# The forms #26 found passing: a kernel package name built from pieces, an importer under another name, and a
# dispatcher fed a kernel name from its own file.
ISSUE_26_BYPASSES = [
    ("register_backend('x', 'moe_hopper' + '_fp8.megamoe_kernel_fp8:K', arch='sm90')\n", "kernel-target"),
    ("K = 'megamoe_kernel_fp8'\nregister_backend('x', f'moe_hopper_fp8.{K}:Kernel', arch='sm90')\n", "kernel-target"),
    ("register_backend('x', ':'.join(['moe_hopper_fp8.megamoe_kernel_fp8', 'K']), arch='sm90')\n", "kernel-target"),
    ("register_backend('x', '%s.megamoe_kernel_fp8:K' % 'moe_hopper_fp8', arch='sm90')\n", "kernel-target"),
    ("import importlib\nPKG = 'moe_' + 'hopper_fp8'\nm = importlib.import_module(PKG + '.megamoe_kernel_fp8')\n",
     "kernel-import"),
    ("from importlib import import_module as im\nm = im('moe_hopper_fp8.megamoe_kernel_fp8')\n", "kernel-import"),
    ("from importlib import import_module as im\nm = im(name)\n", "computed-import"),
    ("import importlib\nload = importlib.import_module\nm = load('moe_hopper_fp8')\n", "kernel-import"),
    ("imp = __import__\nm = imp('moe_' + 'hopper_fp8')\n", "kernel-import"),
    ("import importlib\nm = getattr(importlib, 'import_module')('src.bootstrap')\n", "kernel-import"),
    ("import builtins\nm = builtins.__dict__['__import__']('moe_hopper_fp8')\n", "kernel-import"),
    ("from importlib.util import spec_from_file_location as sf\ns = sf('k', path)\n", "computed-import"),
]


@pytest.mark.parametrize("source, rule", ISSUE_26_BYPASSES)
def test_issue_26_bypasses_fail_the_check(tmp_path, source, rule):
    found = _found(_repo(tmp_path, {"moe_ep/core/x.py": source}))
    assert [r for _, _, r in found] == [rule], found


def test_a_dispatcher_fed_a_kernel_name_from_its_own_file_fails_the_check(tmp_path):
    # tests/foundation/python_env_test.py's `__import__(module)` is allow-listed by call site: what it imports is
    # the parametrize list beside it.
    source = ("import pytest\n\n@pytest.mark.parametrize('module', ['numpy', 'moe_' + 'hopper_fp8'])\n"
              "def test_import(module):\n    __import__(module)\n")
    found = _found(_repo(tmp_path, {"tests/foundation/python_env_test.py": source}))
    assert found == [("tests/foundation/python_env_test.py", 3, "kernel-name")]
    clean = source.replace("'moe_' + 'hopper_fp8'", "'cutlass'")
    assert _found(_repo(tmp_path / "b", {"tests/foundation/python_env_test.py": clean})) == []


@pytest.mark.parametrize(
    "path, source",
    [
        # the literal head fixes a package that is not a kernel one
        ("moe_ep/x.py", "import importlib\nm = importlib.import_module(f'shim.{arch}.kernel_symbols')\n"),
        ("moe_ep/x.py", "import importlib\nm = importlib.import_module('moe_ep.formats.' + name)\n"),
        # forwarding this interpreter's own path to a child adds nothing
        ("tests/x_test.py", "import os, sys\nenv = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))\n"),
        ("tests/x_test.py", "import os, sys\nenv = {}\nenv['PYTHONPATH'] = os.pathsep.join(sys.path)\n"),
        # the launcher's job
        ("tools/launch/x.py", "import os\nenv = dict(os.environ)\nenv['PYTHONPATH'] = os.pathsep.join(paths)\n"),
        # reading sys.path, or copying it, changes nothing
        ("tools/x.py", "import sys\npaths = [p for p in sys.path if p]\npaths.insert(0, 'x')\nn = len(sys.path)\n"),
        # inside shim/ all of it is the shim's job (the tree guard)
        ("shim/common/y.py", "import importlib, sys\nsys.path[:0] = [d]\nm = importlib.import_module(n)\n"),
        # an allow-listed call site, exactly as listed
        ("moe_ep/core/registry.py", "import importlib\ndef resolve(module):\n    return importlib.import_module(module)\n"),
    ],
)
def test_what_is_not_a_bypass(tmp_path, path, source):
    assert _found(_repo(tmp_path, {path: source})) == []


def test_allow_list_is_per_file_and_per_call(tmp_path):
    same_call_elsewhere = "import importlib\ndef resolve(module):\n    return importlib.import_module(module)\n"
    changed_call = "import importlib\ndef resolve(module):\n    return importlib.import_module(module + '.x')\n"
    assert _found(_repo(tmp_path / "a", {"moe_ep/core/other.py": same_call_elsewhere})) == [
        ("moe_ep/core/other.py", 3, "computed-import")]
    assert _found(_repo(tmp_path / "b", {"moe_ep/core/registry.py": changed_call})) == [
        ("moe_ep/core/registry.py", 3, "computed-import")]


def test_allow_list_entries_match_this_checkout():
    """A stale entry would silently allow whatever later lands at that call; each must still be there."""
    import ast

    root = _repo_root()
    entries = list(layering.COMPUTED_IMPORT_ALLOWED) + list(layering.SYS_PATH_ALLOWED)
    stale = []
    for rel, call in entries:
        path = root / rel
        texts = set()
        if path.is_file():
            texts = {ast.unparse(n) for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                     if isinstance(n, (ast.Call, ast.stmt))}
        if call not in texts:
            stale.append(f"{rel}: {call}")
    stale += [f"{rel} (exempt file)" for rel in layering.EXEMPT_FILES if not (root / rel).is_file()]
    assert not stale, "allow-list entries with no such call site any more:\n" + "\n".join(stale)
    reasons = (list(layering.COMPUTED_IMPORT_ALLOWED.values()) + list(layering.SYS_PATH_ALLOWED.values())
               + list(layering.EXEMPT_FILES.values()))
    assert all(len(r) > 20 for r in reasons)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
