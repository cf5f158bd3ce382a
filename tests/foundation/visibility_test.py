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
    assert proc.returncode == 0, f"the control fixture must build; nested bazel said:\n{proc.stderr[-6000:]}"


@pytest.mark.parametrize("target", sorted(VIOLATIONS))
def test_kernel_dependency_outside_shim_is_rejected(target):
    kernel = VIOLATIONS[target]
    proc = _analyse(target)
    assert proc.returncode != 0, f"{target} depends on {kernel} from outside //shim and still built"
    expected = f"target '{kernel}' is not visible from target '{target}'"
    assert expected in proc.stderr, (
        f"{target} failed, but not with the visibility error ({expected!r}); nested bazel said:\n"
        f"{proc.stderr[-6000:]}"
    )
    print(f"rejected as expected: {expected}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
