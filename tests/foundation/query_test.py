"""Build-graph facts about the kernel trees, read from `bazel query` (the nested Bazel server of conftest.py, shared
with visibility_test.py in //tests/foundation:build_graph_test).

1. Only //shim/... targets depend directly on a kernel package (the py_libraries of
   @cutedsl_megamoe_sm90 / @cutedsl_megamoe_sm100). The one exception is the deliberate
   violation fixture in //tests/fixtures/visibility, which never builds (visibility_test).
2. No target depends on both trees (one process can hold one tree). test_suites, which only
   group tests, are exempt, and so is the one-tree fixture in //tests/fixtures/visibility, which
   never analyses (visibility_test); the query must see it, or this check could not fail.
3. A target under //shim/sm90 reaches only the sm90 tree, one under //shim/sm100 only sm100.
"""

import collections
import re
import sys

import pytest

from tests.foundation import nested_bazel

TREES = {"sm90": "@cutedsl_megamoe_sm90//", "sm100": "@cutedsl_megamoe_sm100//"}
FIXTURE_PREFIX = "//tests/fixtures/visibility:"
QUERY_FLAGS = ["--noimplicit_deps", "--keep_going=false"]


def _query(server, expr, *flags):
    proc = server.run("query", [*QUERY_FLAGS, *flags, expr])
    if proc.returncode != 0:
        pytest.fail(f"bazel query {expr!r} failed (exit {proc.returncode}):\n{nested_bazel.errors(proc)}", pytrace=False)
    return proc.stdout


def _universe():
    """//... spelled out per top-level directory.

    A nested Bazel does not recognise the outer Bazel's convenience symlinks (bazel-<dir>, which
    point into another output base) as its own, so a literal //... would walk into them.
    Directories listed in .bazelignore (separate workspaces such as examples/downstream) hold no
    package of this one: a top-level directory with BUILD files only there is left out.
    """
    root = nested_bazel.workspace_root()
    ignored = nested_bazel.bazelignored()

    def has_package(p):
        return any(
            not any(f.is_relative_to(i) for i in ignored) for f in [*p.rglob("BUILD"), *p.rglob("BUILD.bazel")]
        )

    dirs = sorted(
        p.name
        for p in root.iterdir()
        if p.is_dir()
        and not p.is_symlink()
        and not p.name.startswith((".", "bazel-"))
        and has_package(p)
    )
    return "(" + " + ".join(["//:*"] + [f"//{d}/..." for d in dirs]) + ")"


@pytest.fixture(scope="module")
def graph(workspace_bazel):
    """(kind of every node, edges) of deps(//...), explicit dependencies only."""
    kinds = {}
    universe = _universe()
    everything = " + ".join([f"deps({universe})"] + [f"{prefix}:*" for prefix in TREES.values()])
    for line in _query(workspace_bazel, everything, "--output=label_kind").splitlines():
        m = re.match(r"^(.+?) (?:rule )?(//\S*|@\S+)$", line.strip())
        if m:
            kinds[m.group(2)] = m.group(1)
    edges = collections.defaultdict(set)
    for line in _query(workspace_bazel, f"deps({universe})", "--output=graph", "--nograph:factored").splitlines():
        m = re.match(r'^\s*"([^"]+)"\s*->\s*"([^"]+)"', line)
        if m:
            edges[m.group(1)].add(m.group(2))
    return kinds, edges


def _kernel_packages(kinds, tree):
    prefix = TREES[tree]
    return {label for label, kind in kinds.items() if label.startswith(prefix) and kind == "py_library"}


def _reaches(edges, sources, targets):
    """Every node of `sources` from which some node of `targets` is reachable."""
    reverse = collections.defaultdict(set)
    for a, bs in edges.items():
        for b in bs:
            reverse[b].add(a)
    seen, todo = set(targets), list(targets)
    while todo:
        node = todo.pop()
        for parent in reverse[node]:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return {s for s in sources if s in seen}


def test_every_tree_has_kernel_packages(graph):
    kinds, _ = graph
    for tree, prefix in TREES.items():
        labels = _kernel_packages(kinds, tree)
        assert {f"{prefix}:common", f"{prefix}:src"} <= labels, f"{tree}: kernel packages seen: {sorted(labels)}"


def test_only_shim_depends_on_kernel_packages(graph):
    kinds, edges = graph
    kernels = _kernel_packages(kinds, "sm90") | _kernel_packages(kinds, "sm100")
    direct = sorted(
        a for a, bs in edges.items() if bs & kernels and a.startswith("//") and not a.startswith("//shim/")
    )
    offenders = [a for a in direct if not a.startswith(FIXTURE_PREFIX)]
    assert not offenders, f"targets outside //shim depend directly on kernel packages: {offenders}"
    users = sorted(a for a, bs in edges.items() if bs & kernels and a.startswith("//"))
    print("direct users of kernel packages:", users)


def test_no_target_depends_on_both_trees(graph):
    kinds, edges = graph
    ours = [n for n in kinds if n.startswith("//")]
    reach = {tree: _reaches(edges, ours, _kernel_packages(kinds, tree)) for tree in TREES}
    both = sorted(n for n in reach["sm90"] & reach["sm100"] if kinds.get(n) != "test_suite")
    fixtures = {f"{FIXTURE_PREFIX}{name}{suffix}" for name in ("both_trees", "both_trees_through_data")
                for suffix in ("", ".one_tree")}
    assert fixtures <= set(both), f"the query no longer sees the one-tree fixtures {sorted(fixtures)}: {both}"
    both = [n for n in both if n not in fixtures]
    assert not both, f"targets that depend on both kernel trees (one process can hold one tree): {both}"


def test_shim_arch_dirs_stay_on_their_tree(graph):
    kinds, edges = graph
    ours = [n for n in kinds if n.startswith("//")]
    for tree, other in (("sm90", "sm100"), ("sm100", "sm90")):
        crossing = sorted(
            n for n in _reaches(edges, ours, _kernel_packages(kinds, other)) if n.startswith(f"//shim/{tree}")
        )
        assert not crossing, f"//shim/{tree} targets reach the {other} tree: {crossing}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
