"""The one label every BUILD file loads Python rules from.

    load("//tools/bazel:py.bzl", "py_library", "py_binary", "py_test")

From another workspace (an engine's): load("@megamoe_ep//tools/bazel:py.bzl", ...): the same rules,
and the only way to get the legacy_create_init default below without a .bazelrc line.

Today these wrap Bazel 4's built-in rules (rules_python is not reachable here). When rules_python
becomes available, only this file changes. //tests/foundation:py_rules_test fails on any BUILD
file that calls a native Python rule directly or loads one from elsewhere.

The interpreter is not chosen here: the registered toolchain (@moe_ep_python, a venv built from
//:requirements.lock by tools/bazel/python_env.bzl) runs every py_binary and py_test. There are
no per-package labels for PyPI packages: everything in the lock is importable by every target.

GPU tests: use gpu_py_test below; it tags each variant `gpu_<arch>` (plus `gpu`, `exclusive`),
which the plain configuration filters out and --config=hopper / --config=blackwell select.

One tree per process: every py_library / py_binary / py_test with deps or data carries a `<name>.one_tree` check
(one_tree.bzl) that fails the target's analysis when its deps or data reach both kernel trees.

No test that checks nothing: every py_test's main is //tools/bazel:pytest_runner.py with the test's files written in
(`<name>.pytest_main.py`), which runs them under pytest and fails the target when no case ran (nothing collected, or
everything skipped). The test's file is `main` when given, else its one source, else its sources named `*_test.py`
(one pytest session: they share session fixtures), else `<name>.py`; a file's own `__main__` block is not used.
"""

load("@bazel_tools//tools/python:toolchain.bzl", _py_runtime_pair = "py_runtime_pair")
load(":one_tree.bzl", "with_one_tree_check")

GPU_ARCHS = ["sm90", "sm100"]

def py_library(name, **kwargs):
    native.py_library(name = name, **with_one_tree_check(name, kwargs))

# legacy_create_init = False: Bazel invents no __init__.py in runfiles, so the kernel trees stay
# byte-identical to their manifests. This repo's .bazelrc says the same for every target
# (--incompatible_default_to_explicit_init_py); the attribute makes it hold in a consumer's
# workspace too, whatever its .bazelrc says.
def py_binary(name, **kwargs):
    kwargs.setdefault("python_version", "PY3")
    kwargs.setdefault("srcs_version", "PY3")
    kwargs.setdefault("legacy_create_init", False)
    native.py_binary(name = name, **with_one_tree_check(name, kwargs))

# The template of every py_test's main (see the module docstring). A Label: it resolves to this repository from an
# engine's workspace too.
_PYTEST_RUNNER = Label("//tools/bazel:pytest_runner.py")

def _runfiles_path(ctx, f):
    # "<repository>/<path>", the file's place under the runfiles root, for the main repository and external ones.
    return f.short_path[3:] if f.short_path.startswith("../") else ctx.workspace_name + "/" + f.short_path

def _pytest_main_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".py")
    ctx.actions.expand_template(
        template = ctx.file._runner,
        output = out,
        substitutions = {
            "@TEST_FILES@": " ".join([_runfiles_path(ctx, f) for f in ctx.files.test_files]),
            "@THIS_FILE@": _runfiles_path(ctx, out),
        },
    )
    return [DefaultInfo(files = depset([out]))]

_pytest_main = rule(
    implementation = _pytest_main_impl,
    attrs = {
        "test_files": attr.label_list(allow_files = [".py"], mandatory = True),
        "_runner": attr.label(default = _PYTEST_RUNNER, allow_single_file = True),
    },
    doc = "pytest_runner.py with one test's files written in: that test's main.",
)

def _test_files(name, srcs, main):
    """The files a py_test runs: its main; else its one source; else its sources named *_test.py (one pytest
    session); else <name>.py, Bazel's own default."""
    if main != None:
        return [main]
    if len(srcs) == 1:
        return srcs
    return [s for s in srcs if s.endswith("_test.py")] or [name + ".py"]

def py_test(name, srcs = [], main = None, **kwargs):
    """A py_test whose files run under pytest_runner.py: at least one test case must run, or the test fails."""
    runner = name + ".pytest_main"
    _pytest_main(
        name = runner,
        test_files = _test_files(name, srcs, main),
        testonly = True,
        tags = [t for t in kwargs.get("tags", []) if t == "manual"],
        visibility = ["//visibility:private"],
    )
    kwargs.setdefault("python_version", "PY3")
    kwargs.setdefault("srcs_version", "PY3")
    kwargs.setdefault("legacy_create_init", False)
    native.py_test(
        name = name,
        srcs = srcs + [":" + runner],
        main = ":" + runner + ".py",
        **with_one_tree_check(name, kwargs, testonly = True)
    )

def py_runtime(**kwargs):
    native.py_runtime(**kwargs)

py_runtime_pair = _py_runtime_pair

def gpu_py_test(name, srcs, archs = GPU_ARCHS, tags = [], env = {}, main = None, **kwargs):
    """One py_test per GPU arch, `<name>_<arch>`, plus a test_suite `<name>` over them.

    Each variant gets tags `gpu`, `gpu_<arch>` and `exclusive` (multi-rank tests want every GPU
    of the host), and MOE_EP_ARCH=<arch> in its environment. They only run under
    --config=hopper (gpu_sm90) or --config=blackwell (gpu_sm100); a plain `bazel test //...`
    filters them out by tag.
    """
    if main == None and len(srcs) == 1:
        main = srcs[0]
    for arch in archs:
        if arch not in GPU_ARCHS:
            fail("gpu_py_test(%s): arch %r is not one of %s" % (name, arch, GPU_ARCHS))
        variant_env = dict(env)
        variant_env["MOE_EP_ARCH"] = arch
        py_test(
            name = "%s_%s" % (name, arch),
            srcs = srcs,
            main = main,
            env = variant_env,
            tags = tags + ["gpu", "gpu_" + arch, "exclusive"],
            **kwargs
        )
    native.test_suite(
        name = name,
        tests = [":%s_%s" % (name, arch) for arch in archs],
        tags = tags,
    )
