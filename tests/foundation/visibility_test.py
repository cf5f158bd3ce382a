"""The layering rule bites: Bazel rejects a dependency on a kernel package from outside //shim.

Builds (analysis only) the manual fixtures in //tests/fixtures/visibility with a nested Bazel:
the control target must pass, and each violation must fail with Bazel's visibility error
naming the kernel package and the offending target.
"""

import sys

import pytest

from tests.foundation import nested_bazel

FIXTURES = "//tests/fixtures/visibility"

VIOLATIONS = {
    f"{FIXTURES}:outside_shim_uses_sm90_kernel": "@cutedsl_megamoe_sm90//:moe_hopper_fp8",
    f"{FIXTURES}:outside_shim_uses_sm100_kernel": "@cutedsl_megamoe_sm100//:moe_mxfp8_glu",
}


def _analyse(target):
    return nested_bazel.bazel("build", ["--nobuild", "--symlink_prefix=/", "--keep_going", target])


def test_control_fixture_analyses():
    proc = _analyse(f"{FIXTURES}:control_reads_tree_files")
    if proc.returncode != 0:
        pytest.fail(f"the control fixture must build; nested bazel said:\n{nested_bazel.errors(proc)}", pytrace=False)


@pytest.mark.parametrize("target", sorted(VIOLATIONS))
def test_kernel_dependency_outside_shim_is_rejected(target):
    kernel = VIOLATIONS[target]
    proc = _analyse(target)
    if proc.returncode == 0:
        pytest.fail(f"{target} depends on {kernel} from outside //shim and still built", pytrace=False)
    expected = f"target '{kernel}' is not visible from target '{target}'"
    if expected not in proc.stderr:
        pytest.fail(
            f"{target} failed, but not with the visibility error ({expected!r}); nested bazel said:\n"
            f"{nested_bazel.errors(proc)}",
            pytrace=False,
        )
    print(f"rejected as expected: {expected}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
