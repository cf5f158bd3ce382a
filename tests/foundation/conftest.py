"""Session fixtures of //tests/foundation:build_graph_test, whose files (visibility_test.py, query_test.py) ask one
nested Bazel about this workspace: one server, one load of the workspace's packages for all of them."""

import pytest

from tests.foundation import nested_bazel


@pytest.fixture(scope="session")
def workspace_bazel():
    server = nested_bazel.Server()
    yield server
    server.shutdown()
