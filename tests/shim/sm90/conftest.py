import pytest



@pytest.fixture(scope="session")
def sm90_tree():
    """Puts the Hopper tree on sys.path (Bazel: the data dependency; elsewhere $MOE_EP_SM90_TREE)."""
    from shim.common import tree

    try:
        return tree.activate("sm90")
    except tree.TreeNotFoundError as e:
        pytest.fail(str(e))


# The GPU suites' fixtures (per-rank process group, case log, shared seed), shared with the sm100 suite.
from tests.support.gpu import case_log, dist_ctx, shared_seed  # noqa: E402,F401
