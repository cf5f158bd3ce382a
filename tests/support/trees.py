"""The kernel trees as session fixtures named `sm90_tree` and `sm100_tree`: each puts the pinned tree on sys.path
(Bazel: the data dependency; elsewhere $MOE_EP_SM90_TREE / $MOE_EP_SM100_TREE) and fails the test that needs a
missing one, never skips. A conftest imports them under these names (`from tests.support.trees import
sm90_tree_fixture  # noqa: F401`), so that a fixture's `sm90_tree` argument shadows no import."""
import pytest

__all__ = ["sm90_tree_fixture", "sm100_tree_fixture"]


def _activate(arch: str):
    from shim.common import tree

    try:
        return tree.activate(arch)
    except tree.TreeNotFoundError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session", name="sm90_tree")
def sm90_tree_fixture():
    return _activate("sm90")


@pytest.fixture(scope="session", name="sm100_tree")
def sm100_tree_fixture():
    return _activate("sm100")
