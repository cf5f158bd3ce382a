"""CPU tests of the Blackwell shim. The sm100 tree comes from Bazel (the //shim/sm100 data dependency) or,
outside Bazel, from $MOE_EP_SM100_TREE; a missing tree fails the test that needs it, it never skips.
Without a GPU, compiles target sm_100a."""
import os

import pytest
import torch

# Compile-only builds need a target; on a host with a GPU cutlass reads the device's own (sm_100a on B200,
# sm_103a on B300), and forcing one here would build the wrong code for the other.
if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")

from tests.support.trees import sm100_tree_fixture  # noqa: E402,F401 (the `sm100_tree` fixture)


@pytest.fixture(scope="session")
def ks(sm100_tree):
    from shim.sm100 import kernel_symbols

    return kernel_symbols


# The GPU suites' fixtures (per-rank process group, case log, shared seed), shared with the sm90 suite.
from tests.support.gpu import case_log, dist_ctx, shared_seed  # noqa: E402,F401
