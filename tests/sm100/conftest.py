"""CPU tests of the Blackwell shim. The sm100 tree comes from Bazel (the //shim/sm100 data dependency) or,
outside Bazel, from $MOE_EP_SM100_TREE; a missing tree fails the test that needs it, it never skips.
Compiles target sm_100a without a GPU."""
import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")


@pytest.fixture(scope="session")
def sm100_tree():
    from shim.common import tree

    try:
        return tree.activate("sm100")
    except tree.TreeNotFoundError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def ks(sm100_tree):
    from shim.sm100 import kernel_symbols

    return kernel_symbols
