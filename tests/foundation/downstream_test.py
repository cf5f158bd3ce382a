"""An engine's workspace builds and tests moe_ep: examples/downstream, by a nested Bazel; and what goes wrong for an
engine is said in the engine's terms.

examples/downstream is a separate workspace (its own WORKSPACE, .bazelrc, BUILD) that reaches this repository by
path as @megamoe_ep and calls megamoe_ep_repositories(), exactly what docs/downstream.md shows (checked here too).
A second Bazel, a server with its own --output_user_root under TEST_TMPDIR, runs in that workspace:

  - one `bazel test --keep_going` over every target of the example, the manual ones too:
    `//:two_ranks_test` (2 CPU ranks through moe_ep's public API, checked against the oracle) passes;
    `//:hopper_layer` (a py_binary on @megamoe_ep//moe_ep:moe_ep_hopper, which carries the Hopper kernel tree)
    builds; `//:both_trees` (both arch targets in deps) and `//:data_escape` (the Blackwell one as data) fail
    their analysis with the one-tree check's error naming both trees; `//:kernel_direct` (a kernel package from
    outside megamoe_ep's shim) fails with Bazel's visibility error, whose first line names it, not its check;
  - `bazel query`: with the coverage override the docs give it works, with --noimplicit_deps alone it does not;
    `@megamoe_ep//...` works over a checkout that has been built in place (megamoe-ep's .bazelignore leaves its
    convenience symlinks out).

Then a batch Bazel in examples/downstream/wrong_pin, an engine whose own Hopper pin has the wrong sha256, with a
stand-in for pip (no network): the fetch fails, and its explanation, printed once for two targets that need the
tree, tells the engine what to change in its own WORKSPACE, not in megamoe-ep's files; and the fetch prints none of
Bazel's download lines (a first build is quiet).

Offline and quick: the drop trees and the venv the outer build already has are handed over with
--override_repository (tests/foundation/nested_bazel.py). @remote_coverage_tools is not: the example's own
.bazelrc line has to be enough, as it is for a consumer. It checks files outside its declared inputs (the example,
the docs, the whole repository it loads): the source digest among its data reruns it when any of them changes.
"""

import os
import re
import sys
import time

import pytest

from tests.foundation import nested_bazel

DOC = "docs/downstream.md"
# No convenience symlinks in the source tree; actions run unsandboxed (this test already runs in the outer
# Bazel's sandbox, and the nested test starts processes of its own); a plain log, 2 jobs as on CI.
NESTED = ["--symlink_prefix=/", "--spawn_strategy=local", "--jobs=2", "--curses=no", "--color=no"]
QUERY = ["--curses=no", "--color=no"]
BUILT = ["//:two_ranks_test", "//:hopper_layer"]
REFUSED = ["//:both_trees", "//:data_escape", "//:kernel_direct"]


def _example():
    return nested_bazel.workspace_root() / "examples" / "downstream"


def _blocks():
    """{info string: [block text, ...]} of the fenced code blocks of docs/downstream.md."""
    text = (nested_bazel.workspace_root() / DOC).read_text(encoding="utf-8")
    out = {}
    for info, body in re.findall(r"^```([^\n]*)\n(.*?)^```", text, flags=re.M | re.S):
        out.setdefault(info.strip(), []).append(body)
    return out


def _timed(what, run):
    t0 = time.monotonic()
    proc = run()
    print(f"nested `bazel {what}`: exit {proc.returncode} after {time.monotonic() - t0:.1f} s")
    return proc


def _ok(proc, what):
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        pytest.fail(f"nested `bazel {what}` failed (exit {proc.returncode}):\n{nested_bazel.errors(proc)}\n"
                    f"--- tail\n{tail}", pytrace=False)
    return proc


def _not_built(proc, target):
    return f"errors encountered while analyzing target '{target}'" in proc.stderr


def test_docs_show_the_example_workspace_and_bazelrc():
    blocks = _blocks()
    for name, info in (("WORKSPACE", "python"), (".bazelrc", "sh")):
        want = (_example() / name).read_text(encoding="utf-8")
        shown = blocks.get(f"{info} title={name}", [])
        assert shown == [want], (
            f"{DOC} must show examples/downstream/{name} verbatim in one ```{info} title={name} block; it shows "
            f"{shown!r}, the file is {want!r}")


def test_docs_build_snippet_is_from_the_example():
    shown = _blocks().get("python title=BUILD.bazel", [])
    assert len(shown) == 1, f"{DOC} must show one ```python title=BUILD.bazel block"
    example = (_example() / "BUILD.bazel").read_text(encoding="utf-8")
    missing = [l for l in shown[0].splitlines() if l.strip() and l not in example.splitlines()]
    assert not missing, f"{DOC} BUILD lines not in examples/downstream/BUILD.bazel: {missing}"


@pytest.fixture(scope="module")
def example():
    server = nested_bazel.Server(cwd=_example(), coverage_stub=False)
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def build(example):
    """One `bazel test --keep_going` over the example's targets: the test runs, the binary builds, the refused
    ones fail their analysis, each for its own reason."""
    return _timed("test", lambda: example.run(
        # The example's sizes are a consumer's; on a loaded CI machine its two ranks get longer than `small`'s 60 s.
        "test", NESTED + ["--keep_going", "--test_output=errors", "--test_timeout=300", *BUILT, *REFUSED],
        timeout=600))


def test_example_two_ranks_test_passes(build):
    said = build.stdout + build.stderr
    assert re.search(r"^//:two_ranks_test\s+PASSED", said, flags=re.M), \
        f"//:two_ranks_test did not pass:\n{nested_bazel.errors(build)}\n{said[-3000:]}"


def test_example_hopper_binary_builds(build):
    if _not_built(build, "//:hopper_layer"):
        pytest.fail(f"//:hopper_layer did not build:\n{nested_bazel.errors(build)}", pytrace=False)


@pytest.mark.parametrize("target, arch_dep", [
    ("//:both_trees", "sm100 (Blackwell): //:both_trees -> @megamoe_ep//moe_ep:moe_ep_blackwell ->"),
    ("//:data_escape", "sm100 (Blackwell): //:data_escape -> @megamoe_ep//moe_ep:moe_ep_blackwell ->"),
])
def test_example_target_on_both_trees_fails_analysis_naming_both(build, target, arch_dep):
    assert build.returncode != 0 and _not_built(build, target), \
        f"{target} reaches both kernel trees and still analysed:\n{nested_bazel.errors(build)}"
    want = [f"{target} depends on both kernel trees", f"sm90 (Hopper): {target} -> @megamoe_ep//moe_ep:moe_ep_hopper ->",
            arch_dep]
    missing = [w for w in want if w not in build.stderr]
    assert not missing, f"the error lacks {missing}:\n{nested_bazel.errors(build)}"


def test_example_kernel_package_dependency_is_refused_in_the_targets_name(build):
    assert _not_built(build, "//:kernel_direct"), f"//:kernel_direct analysed:\n{nested_bazel.errors(build)}"
    errors = [l for l in build.stderr.splitlines() if l.startswith("ERROR") and "kernel_direct" in l]
    assert errors and "is not visible from target '//:kernel_direct'" in errors[0], errors
    assert not [l for l in errors if "kernel_direct.one_tree" in l], errors


def test_query_in_the_example_needs_the_coverage_override(example):
    # What docs/downstream.md says a consumer's `bazel query` needs: the override of @remote_coverage_tools, which
    # --noimplicit_deps alone does not replace (the test rules' coverage attribute still loads it).
    stub = nested_bazel.workspace_root() / "tools" / "bazel" / "coverage_stub"
    override = f"--override_repository=remote_coverage_tools={stub}"
    ok = _ok(_timed("query", lambda: example.run("query", QUERY + [override, "deps(//:two_ranks_test)"])), "query")
    assert "@megamoe_ep//moe_ep:moe_ep" in ok.stdout
    alone = _timed("query", lambda: example.run("query", QUERY + ["--noimplicit_deps", "deps(//:two_ranks_test)"]))
    assert alone.returncode != 0 and "remote_coverage_tools" in alone.stderr, alone.stderr[-2000:]


def _built_checkout(tmp_path):
    """This checkout as a consumer's local_repository sees one cloned as megamoe-ep and built in place: every
    top-level entry linked, its convenience symlinks included, the one named after its directory renamed to
    bazel-megamoe-ep (the outer build made it; the nested Bazel must not walk into it)."""
    root = nested_bazel.workspace_root()
    farm = tmp_path / "megamoe-ep"
    farm.mkdir()
    for entry in root.iterdir():
        name = "bazel-megamoe-ep" if entry.name == f"bazel-{root.name}" else entry.name
        (farm / name).symlink_to(entry)
    assert (farm / "bazel-out").is_symlink() and (farm / "bazel-megamoe-ep").is_symlink(), \
        f"{root} has not been built in place (no bazel-out / bazel-{root.name})"
    return farm


def test_query_of_every_megamoe_ep_package_skips_a_checkouts_bazel_symlinks(example, tmp_path):
    stub = nested_bazel.workspace_root() / "tools" / "bazel" / "coverage_stub"
    farm = _built_checkout(tmp_path)
    proc = _ok(_timed("query", lambda: example.run("query", QUERY + [
        f"--override_repository=remote_coverage_tools={stub}", f"--override_repository=megamoe_ep={farm}",
        "--keep_going=false", "@megamoe_ep//..."])), "query @megamoe_ep//...")
    labels = proc.stdout.split()
    assert "@megamoe_ep//moe_ep:moe_ep" in labels
    assert not [l for l in labels if l.startswith("@megamoe_ep//bazel-")], "the query walked into bazel-* links"


STAND_IN_PYTHON = """#!/bin/sh
# Stands in for the base python of drop_repo.bzl: `-m pip download ... --dest DIR SPEC` writes a wheel that is not
# the pinned one (no network); everything else is the real interpreter.
if [ "$1 $2 $3" = "-m pip download" ]; then
  while [ $# -gt 0 ]; do
    if [ "$1" = "--dest" ]; then dest=$2; fi
    shift
  done
  mkdir -p "$dest" && printf 'not the pinned wheel' > "$dest/flashinfer_python-0.7.4-py3-none-any.whl"
  echo "Saved $dest/flashinfer_python-0.7.4-py3-none-any.whl (stand-in)"
  exit 0
fi
exec {python} "$@"
"""


def test_a_consumers_wrong_pin_is_explained_once_in_the_consumers_terms(tmp_path):
    python = tmp_path / "python3"
    python.write_text(STAND_IN_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    proc = _timed("build (wrong pin)", lambda: nested_bazel.bazel(
        "build", NESTED + ["--keep_going", "//..."], cwd=_example() / "wrong_pin", coverage_stub=False,
        fetch=["cutedsl_megamoe_sm90"], env={"MOE_EP_PYTHON": str(python)}, timeout=600))
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said[-3000:]
    assert said.count("CARRIER HASH MISMATCH") == 1, f"the explanation is not printed once:\n{said[-6000:]}"
    box = said[said.index("CARRIER HASH MISMATCH"):]
    box = box[:box.index("=" * 40)]
    print(box)
    for want in ("pinned:   sha256 bfdc18b9e1e4d8d0730fe4343dc0e284cd0c160086de80f99888bc4867922d49",
                 "The pin is yours", 'megamoe_ep_repositories(sm90_version = "0.7.4", sm90_sha256 = "...")',
                 "in your\nWORKSPACE", "sha256sum"):
        assert want in box, f"the explanation lacks {want!r}:\n{box}"
    assert "workspace.bzl" not in box and "bazel run //tools:drop -- bump" not in box, box
    # Nothing else from the fetch: the repository-cache miss and the wheel's hash print no Bazel line of their own
    # (a probe URL that does not exist printed "WARNING: Download from ... failed", a download without an expected
    # hash "INFO: SHA256 (...) = ...", one per tree, on every first build).
    noise = [l for l in said.splitlines() if re.match(r"(WARNING: Download from|INFO: SHA256 )", l)]
    assert not noise, "the fetch printed Bazel's download lines:\n" + "\n".join(noise)
    # Each target that needed the tree repeats one line pointing at it, not the explanation.
    repeats = [l for l in said.splitlines() if l.startswith("ERROR") and "printed above" in l]
    assert len(repeats) >= 2, f"expected an error line per target that needs the tree:\n{said[-6000:]}"
    print(f"{len(said.splitlines())} lines of output, {len(repeats)} one-line repeats")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-rA", "-p", "no:cacheprovider"]))
