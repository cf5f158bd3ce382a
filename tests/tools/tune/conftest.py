from tests.support.trees import sm90_tree_fixture  # noqa: F401 (the `sm90_tree` fixture)
