"""An engine's workspace builds and tests moe_ep: examples/downstream, by a nested Bazel.

examples/downstream is a separate workspace (its own WORKSPACE, .bazelrc, BUILD) that reaches this
repository by path as @megamoe_ep and calls megamoe_ep_repositories(), exactly what docs/downstream.md
("Using moe_ep from your Bazel workspace") shows (checked here too). A second Bazel, in batch
mode with its own --output_user_root under TEST_TMPDIR, runs in that workspace:

  - `bazel test //:two_ranks_test`: 2 CPU ranks through moe_ep's public API, checked against the
    oracle;
  - `bazel build //:hopper_layer`: a py_binary on @megamoe_ep//moe_ep:moe_ep_hopper, which carries
    the Hopper kernel tree (built only: it needs a Hopper GPU to run);
  - `bazel build //:both_trees` (in the same nested build, --keep_going): a py_binary on both arch targets
    fails its analysis with the one-tree check's error naming both (a CPU-only CI sees it, not only a GPU run).

Offline and quick: the drop trees and the venv the outer build already has are handed over with
--override_repository (tests/foundation/nested_bazel.py). @remote_coverage_tools is not: the
example's own .bazelrc line has to be enough, as it is for a consumer. It checks files outside its
declared inputs (the example, docs/downstream.md, the whole repository it loads): the source digest among its
data reruns it when any of them changes.
"""

import re
import sys
import time

import pytest

from tests.foundation import nested_bazel

DOC = "docs/downstream.md"
SECTION = "## Using moe_ep from your Bazel workspace"
# No convenience symlinks in the source tree; actions run unsandboxed (this test already runs in the outer
# Bazel's sandbox, and the nested test starts processes of its own); a plain log, 2 jobs as on CI.
NESTED = ["--symlink_prefix=/", "--spawn_strategy=local", "--jobs=2", "--curses=no", "--color=no"]
QUERY = ["--curses=no", "--color=no"]


def _example():
    return nested_bazel.workspace_root() / "examples" / "downstream"


def _section():
    text = (nested_bazel.workspace_root() / DOC).read_text(encoding="utf-8")
    assert SECTION in text, f"{DOC} has no section {SECTION!r}"
    body = text.split(SECTION, 1)[1]
    return re.split(r"^## ", body, maxsplit=1, flags=re.M)[0]


def _blocks(section):
    """{info string: [block text, ...]} of the section's fenced code blocks."""
    out = {}
    for info, body in re.findall(r"^```([^\n]*)\n(.*?)^```", section, flags=re.M | re.S):
        out.setdefault(info.strip(), []).append(body)
    return out


def _run(command, args, timeout, expect_failure=False):
    t0 = time.monotonic()
    flags = QUERY if command == "query" else NESTED  # query takes no build options
    proc = nested_bazel.bazel(command, flags + args, timeout=timeout, cwd=_example(), coverage_stub=False)
    took = time.monotonic() - t0
    print(f"nested `bazel {command}` in examples/downstream: exit {proc.returncode} after {took:.1f} s")
    if expect_failure:
        return proc
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        pytest.fail(f"nested `bazel {command} {' '.join(args)}` in {_example()} failed (exit {proc.returncode}):\n"
                    f"{nested_bazel.errors(proc)}\n--- tail\n{tail}", pytrace=False)
    return proc


def test_readme_shows_the_example_workspace_and_bazelrc():
    blocks = _blocks(_section())
    for name, info in (("WORKSPACE", "python"), (".bazelrc", "sh")):
        want = (_example() / name).read_text(encoding="utf-8")
        shown = blocks.get(f"{info} title={name}", [])
        assert shown == [want], (
            f"{DOC} section {SECTION!r} must show examples/downstream/{name} verbatim in one ```{info} title={name} "
            f"block; it shows {shown!r}, the file is {want!r}")


def test_readme_build_snippet_is_from_the_example():
    shown = _blocks(_section()).get("python title=BUILD.bazel", [])
    assert len(shown) == 1, f"{DOC} must show one ```python title=BUILD.bazel block"
    example = (_example() / "BUILD.bazel").read_text(encoding="utf-8")
    missing = [l for l in shown[0].splitlines() if l.strip() and l not in example.splitlines()]
    assert not missing, f"{DOC} BUILD lines not in examples/downstream/BUILD.bazel: {missing}"


def test_example_two_ranks_test_passes():
    proc = _run("test", ["--test_output=errors", "//:two_ranks_test"], timeout=420)
    assert "//:two_ranks_test" in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def build():
    """One nested `bazel build --keep_going` of the Hopper binary and of the target on both trees (one Bazel
    start for the two): the first must build, the second must fail its analysis."""
    return _run("build", ["--keep_going", "//:hopper_layer", "//:both_trees"], timeout=300, expect_failure=True)


def _not_built(proc, target):
    return f"errors encountered while analyzing target '{target}'" in proc.stderr


def test_example_hopper_binary_builds(build):
    if _not_built(build, "//:hopper_layer") or "//:hopper_layer" not in build.stderr:
        pytest.fail(f"//:hopper_layer did not build:\n{nested_bazel.errors(build)}", pytrace=False)


def test_example_target_on_both_trees_fails_analysis_naming_both(build):
    assert build.returncode != 0 and _not_built(build, "//:both_trees"), \
        f"//:both_trees depends on both kernel trees and still analysed:\n{nested_bazel.errors(build)}"
    want = ["//:both_trees depends on both kernel trees",
            "sm90 (Hopper): //:both_trees -> @megamoe_ep//moe_ep:moe_ep_hopper ->",
            "sm100 (Blackwell): //:both_trees -> @megamoe_ep//moe_ep:moe_ep_blackwell ->"]
    missing = [w for w in want if w not in build.stderr]
    assert not missing, f"the error lacks {missing}:\n{nested_bazel.errors(build)}"


def test_query_in_the_example_needs_the_coverage_override():
    # What docs/downstream.md says a consumer's `bazel query` needs: the override of @remote_coverage_tools, which
    # --noimplicit_deps alone does not replace (the test rules' coverage attribute still loads it).
    stub = nested_bazel.workspace_root() / "tools" / "bazel" / "coverage_stub"
    ok = _run("query", [f"--override_repository=remote_coverage_tools={stub}", "deps(//:two_ranks_test)"],
              timeout=300)
    assert "@megamoe_ep//moe_ep:moe_ep" in ok.stdout
    alone = _run("query", ["--noimplicit_deps", "deps(//:two_ranks_test)"], timeout=300, expect_failure=True)
    assert alone.returncode != 0 and "remote_coverage_tools" in alone.stderr, alone.stderr[-2000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-rA", "-p", "no:cacheprovider"]))
