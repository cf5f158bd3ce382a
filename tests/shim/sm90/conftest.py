from tests.support.trees import sm90_tree_fixture  # noqa: F401 (the `sm90_tree` fixture)

# The GPU suites' fixtures (per-rank process group, case log, shared seed), shared with the sm100 suite.
from tests.support.gpu import case_log, dist_ctx, shared_seed  # noqa: F401
