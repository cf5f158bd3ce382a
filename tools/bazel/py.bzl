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

One tree per process: every py_library / py_binary / py_test with deps carries a `<name>.one_tree` check
(one_tree.bzl) that fails the target's analysis when its deps reach both kernel trees.
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

def py_test(name, **kwargs):
    kwargs.setdefault("python_version", "PY3")
    kwargs.setdefault("srcs_version", "PY3")
    kwargs.setdefault("legacy_create_init", False)
    native.py_test(name = name, **with_one_tree_check(name, kwargs, testonly = True))

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
