"""One process holds one kernel tree: with the Blackwell tree loaded the Hopper one is refused, and the other
way round, whichever way the second one tries to get in.

Each case runs in a fresh interpreter. No test target may depend on both trees (the build-graph rule,
//tests/foundation:query_test), so the Hopper side here is a stand-in tree with the Hopper tree's
top-level package names; the guard decides on names and paths, which is what the stand-in reproduces.
"""
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.usefixtures("sm100_tree")


@pytest.fixture
def hopper_standin(tmp_path):
    """A directory laid out like the Hopper tree's src/ root (its marker package included)."""
    root = tmp_path / "hopper_src"
    for pkg in ("common", "src", "moe_hopper_fp8", "moe_nvfp4_swapab"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text(f"WHICH = 'hopper {pkg}'\n")
    return root


def _run(code, without_sm100_on_path=False, **env):
    """Run `code` in a fresh interpreter that imports what this one does; the sm100 tree is found through
    $MOE_EP_SM100_TREE. without_sm100_on_path: also drop the sm100 repository from the path (under Bazel
    its py_library put it there), as in a process that has not loaded it yet."""
    from shim.common import tree

    root = tree.locate("sm100")
    paths = [p for p in sys.path if p]
    if without_sm100_on_path:
        paths = [p for p in paths if os.path.abspath(p) != root
                 and os.path.basename(os.path.normpath(p)) != tree.TREES["sm100"].repo_name]
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), MOE_EP_SM100_TREE=root,
                    **{k: str(v) for k, v in env.items()})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_hopper_refused_after_blackwell():
    out = _run("""
        import shim.sm100.kernel_symbols as ks
        from shim.common import tree
        assert tree.active_tree()[0] == "sm100"
        import common.megamoe_constants as c
        assert hasattr(c, "Nvfp4BlockSize")
        try:
            tree.activate("sm90")
        except tree.TreeConflictError as e:
            print("REFUSED", e)
        else:
            raise SystemExit("the sm90 tree was activated beside sm100")
        assert tree.activate("sm100") == tree.active_tree()[1]  # the same tree again is fine
    """)
    assert "REFUSED" in out and "already holds the sm100 kernel tree" in out


def test_blackwell_refused_after_hopper(hopper_standin):
    out = _run("""
        from shim.common import tree
        tree.activate("sm90")
        import common
        assert common.WHICH == "hopper common"
        try:
            import shim.sm100.kernel_symbols
        except tree.TreeConflictError as e:
            print("REFUSED", e)
        else:
            raise SystemExit("shim.sm100 loaded beside the sm90 tree")
    """, without_sm100_on_path=True, MOE_EP_SM90_TREE=hopper_standin)
    assert "REFUSED" in out and "already holds the sm90 kernel tree" in out


def test_blackwell_refused_when_a_kernel_name_was_imported_around_the_guard(hopper_standin):
    out = _run(f"""
        import sys
        sys.path.insert(0, {str(hopper_standin)!r})
        import common  # imported by hand, not through shim.common.tree
        from shim.common import tree
        try:
            tree.activate("sm100")
        except tree.TreeConflictError as e:
            print("REFUSED", e)
        else:
            raise SystemExit("sm100 activated over a foreign 'common'")
        assert tree.active_tree() is None
    """)
    assert "REFUSED" in out and "common (from" in out and "hopper_src" in out


def test_blackwell_refused_when_the_hopper_repository_is_on_sys_path(tmp_path):
    other = tmp_path / "cutedsl_megamoe_sm90"
    other.mkdir()
    out = _run(f"""
        import sys
        sys.path.append({str(other)!r})
        from shim.common import tree
        try:
            tree.activate("sm100")
        except tree.TreeConflictError as e:
            print("REFUSED", e)
        else:
            raise SystemExit("sm100 activated with the sm90 repository on sys.path")
    """)
    assert "REFUSED" in out and "a target must depend on one tree only" in out


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
