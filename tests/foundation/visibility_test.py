"""The layering rule bites: Bazel rejects a dependency on a kernel package from outside //shim; and the
one-tree rule bites: a target on both kernel trees fails its analysis.

Builds (analysis only) the manual fixtures in //tests/fixtures/visibility with a nested Bazel (the server of
conftest.py, shared with query_test.py in //tests/foundation:build_graph_test):
the control target must pass, each violation must fail with Bazel's visibility error
naming the kernel package and the offending target (in its first error line, not its generated
`<target>.one_tree` check's), and the binaries on both arch targets (through deps, and one arch
through data) must fail with the one-tree check's error naming both (tools/bazel/one_tree.bzl).
"""

import sys

import pytest

from tests.foundation import nested_bazel

FIXTURES = "//tests/fixtures/visibility"

VIOLATIONS = {
    f"{FIXTURES}:outside_shim_uses_sm90_kernel": "@cutedsl_megamoe_sm90//:moe_hopper_fp8",
    f"{FIXTURES}:outside_shim_uses_sm100_kernel": "@cutedsl_megamoe_sm100//:moe_mxfp8_glu",
}


CONTROL = f"{FIXTURES}:control_reads_tree_files"
BOTH = f"{FIXTURES}:both_trees"
BOTH_THROUGH_DATA = f"{FIXTURES}:both_trees_through_data"


@pytest.fixture(scope="module")
def analysis(workspace_bazel):
    """One nested analysis of every fixture (--keep_going: each one's outcome is reported): its stderr."""
    proc = workspace_bazel.run("build", ["--nobuild", "--symlink_prefix=/", "--keep_going", CONTROL, BOTH,
                                         BOTH_THROUGH_DATA, *sorted(VIOLATIONS)])
    if proc.returncode == 0:
        pytest.fail("every fixture analysed, the violations included", pytrace=False)
    return proc


def _not_built(proc, target):
    return f"errors encountered while analyzing target '{target}'" in proc.stderr


def test_control_fixture_analyses(analysis):
    if _not_built(analysis, CONTROL):
        pytest.fail(f"the control fixture must build; nested bazel said:\n{nested_bazel.errors(analysis)}",
                    pytrace=False)


@pytest.mark.parametrize("target", sorted(VIOLATIONS))
def test_kernel_dependency_outside_shim_is_rejected(analysis, target):
    kernel = VIOLATIONS[target]
    if not _not_built(analysis, target):
        pytest.fail(f"{target} depends on {kernel} from outside //shim and still built", pytrace=False)
    # Reported by the target itself, and by nothing else: its one-tree check (`<target>.one_tree`) takes a direct
    # kernel dependency as a string, so the first error line names the target that declared it.
    expected = f"target '{kernel}' is not visible from target '{target}'"
    errors = [l for l in analysis.stderr.splitlines() if l.startswith("ERROR") and target.rsplit(":", 1)[1] in l]
    assert errors and expected in errors[0], f"the first error about {target} is not its visibility error: {errors}"
    assert not [l for l in errors if f"{target}.one_tree" in l], errors
    if expected not in analysis.stderr:
        pytest.fail(
            f"{target} failed, but not with the visibility error ({expected!r}); nested bazel said:\n"
            f"{nested_bazel.errors(analysis)}",
            pytrace=False,
        )
    print(f"rejected as expected: {expected}")


def test_a_target_on_both_trees_fails_analysis_naming_both(analysis):
    if not _not_built(analysis, BOTH):
        pytest.fail(f"{BOTH} depends on both kernel trees and still analysed", pytrace=False)
    said = analysis.stderr
    want = [f"{BOTH} depends on both kernel trees",
            f"sm90 (Hopper): {BOTH} -> //moe_ep:moe_ep_hopper ->",
            f"sm100 (Blackwell): {BOTH} -> //moe_ep:moe_ep_blackwell ->",
            "@cutedsl_megamoe_sm90//:", "@cutedsl_megamoe_sm100//:"]
    missing = [w for w in want if w not in said]
    if missing:
        pytest.fail(f"{BOTH} failed, but its error lacks {missing}; nested bazel said:\n{nested_bazel.errors(analysis)}",
                    pytrace=False)
    assert f"not visible from target '{BOTH}" not in said  # refused by the one-tree check, not by visibility


def test_a_target_reaching_the_other_tree_through_data_fails_analysis_too(analysis):
    if not _not_built(analysis, BOTH_THROUGH_DATA):
        pytest.fail(f"{BOTH_THROUGH_DATA} has the Blackwell kernels as data and the Hopper ones as deps, and still "
                    "analysed", pytrace=False)
    want = [f"{BOTH_THROUGH_DATA} depends on both kernel trees",
            f"sm90 (Hopper): {BOTH_THROUGH_DATA} -> //moe_ep:moe_ep_hopper ->",
            f"sm100 (Blackwell): {BOTH_THROUGH_DATA} -> //moe_ep:moe_ep_blackwell ->"]
    missing = [w for w in want if w not in analysis.stderr]
    assert not missing, f"the error lacks {missing}:\n{nested_bazel.errors(analysis)}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
