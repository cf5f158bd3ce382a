import pytest


@pytest.fixture(scope="session")
def sm90_tree():
    """Puts the Hopper tree on sys.path (Bazel: the data dependency; elsewhere $MOE_EP_SM90_TREE)."""
    from shim.common import tree

    try:
        return tree.activate("sm90")
    except tree.TreeNotFoundError as e:
        pytest.fail(str(e))
