"""The one-tree rule at analysis time: a target whose dependencies reach both kernel trees fails to build.

The Hopper and the Blackwell drop share their top-level package names, so one process can hold one of them (the
shim refuses a second at run time: TreeConflictError). A CPU-only CI never reaches that run time, so the build
refuses it too: py.bzl's py_library / py_binary / py_test give every target that has deps a `<name>.one_tree`
check among its data. Building or testing the target analyses the check, which walks the deps with an aspect and
fails, before anything is built, with one dependency path into each tree, e.g.

    //:engine depends on both kernel trees; one process can hold only one of them:
      sm100 (Blackwell): //:engine -> @megamoe_ep//moe_ep:moe_ep_blackwell -> ... -> @cutedsl_megamoe_sm100//:common
      sm90 (Hopper): //:engine -> @megamoe_ep//moe_ep:moe_ep_hopper -> ... -> @cutedsl_megamoe_sm90//:common

The check adds no file to runfiles and builds nothing. Targets made with Bazel's native rules directly are not
checked (another reason to load the rules from py.bzl).
"""

# The kernel trees, by repository name (third_party/cutedsl_megamoe/workspace.bzl declares them).
TREES = {
    "cutedsl_megamoe_sm90": "sm90 (Hopper)",
    "cutedsl_megamoe_sm100": "sm100 (Blackwell)",
}

SUFFIX = ".one_tree"

OneTreeInfo = provider(
    doc = "Which kernel trees a target reaches through deps, each with one dependency path down to it.",
    fields = {"paths": "dict: tree repository name -> [label strings], this target first, a kernel package last"},
)

def _aspect_impl(target, ctx):
    paths = {}
    if target.label.workspace_name in TREES:
        paths[target.label.workspace_name] = [str(target.label)]
    for dep in getattr(ctx.rule.attr, "deps", []):
        if OneTreeInfo in dep:
            for tree, path in dep[OneTreeInfo].paths.items():
                if tree not in paths:
                    paths[tree] = [str(target.label)] + path
    return [OneTreeInfo(paths = paths)]

one_tree_aspect = aspect(
    implementation = _aspect_impl,
    attr_aspects = ["deps"],
    doc = "Collects OneTreeInfo along deps.",
)

def _check_impl(ctx):
    owner = str(ctx.label)[:-len(SUFFIX)]
    paths = {}
    for dep in ctx.attr.deps:
        for tree, path in dep[OneTreeInfo].paths.items():
            if tree not in paths:
                paths[tree] = path
    if len(paths) > 1:
        lines = ["%s depends on both kernel trees; one process can hold only one of them:" % owner]
        for tree in sorted(paths):
            lines.append("  %s: %s" % (TREES[tree], " -> ".join([owner] + paths[tree])))
        lines.append("Depend on @megamoe_ep//moe_ep:moe_ep_hopper or @megamoe_ep//moe_ep:moe_ep_blackwell, not " +
                     "both: one binary or test per arch.")
        fail("\n".join(lines))
    return [DefaultInfo()]

one_tree_check = rule(
    implementation = _check_impl,
    attrs = {"deps": attr.label_list(aspects = [one_tree_aspect])},
    doc = "Fails at analysis when its deps reach more than one kernel tree (see the module docstring).",
)

def with_one_tree_check(name, kwargs, testonly = False):
    """kwargs for the py rule `name`, with its `<name>.one_tree` check declared and added to its data (unchanged
    when it has no deps: nothing to check)."""
    deps = kwargs.get("deps")
    if not deps:
        return kwargs
    one_tree_check(
        name = name + SUFFIX,
        deps = deps,
        testonly = kwargs.get("testonly", testonly),
        # A manual target's check is manual too: `bazel build //...` skips both.
        tags = [t for t in kwargs.get("tags", []) if t == "manual"],
        visibility = ["//visibility:private"],
    )
    out = dict(kwargs)
    out["data"] = kwargs.get("data", []) + [":" + name + SUFFIX]
    return out
