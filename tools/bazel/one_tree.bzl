"""The one-tree rule at analysis time: a target whose dependencies reach both kernel trees fails to build.

"Reach" is through `deps` and through `data` alike: kernel code pulled in as data (an arch target of megamoe_ep, a
py_library on a tree) lands in the runfiles where the shim finds it just the same. What counts is Python code of
a tree (a target of a tree repository that provides PyInfo): a tree's plain files as data (its `all_files`,
`carrier.json`), which the manifest and drop tools read from both trees, are files, not a second tree in the
process.

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

A direct dependency on a kernel package (`@cutedsl_megamoe_<tree>//:<package>`, visible to megamoe_ep's shim only)
reaches the check as a string, not as a label: the check never depends on a kernel target itself, so a dependency
Bazel's visibility rule refuses is reported by the target that declared it (`//:engine`), not first by its check
(`//:engine.one_tree`).
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

_WALKED = ["deps", "data"]

def _merge(paths, deps, prefix):
    for dep in deps:
        if OneTreeInfo in dep:
            for tree, path in dep[OneTreeInfo].paths.items():
                if tree not in paths:
                    paths[tree] = prefix + path

def _aspect_impl(target, ctx):
    paths = {}
    if ctx.rule.kind == "one_tree_check":
        return [OneTreeInfo(paths = paths)]  # a dependency's own check: its deps are walked through the dependency
    if target.label.workspace_name in TREES and PyInfo in target:
        paths[target.label.workspace_name] = [str(target.label)]
    for attr in _WALKED:
        _merge(paths, getattr(ctx.rule.attr, attr, []), [str(target.label)])
    return [OneTreeInfo(paths = paths)]

one_tree_aspect = aspect(
    implementation = _aspect_impl,
    attr_aspects = _WALKED,
    doc = "Collects OneTreeInfo along deps and data.",
)

def tree_of(label):
    """The kernel tree repository a label string names (`@cutedsl_megamoe_sm90//:common` -> cutedsl_megamoe_sm90),
    else None."""
    if not label.startswith("@"):
        return None
    repo = label[1:].split("//")[0]
    return repo if repo in TREES else None

def _check_impl(ctx):
    owner = str(ctx.label)[:-len(SUFFIX)]
    paths = {}
    for label in ctx.attr.direct:
        tree = tree_of(label)
        if tree not in paths:
            paths[tree] = [label]
    _merge(paths, ctx.attr.deps + ctx.attr.data, [])
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
    attrs = {
        "data": attr.label_list(aspects = [one_tree_aspect], allow_files = True),
        "deps": attr.label_list(aspects = [one_tree_aspect]),
        "direct": attr.string_list(doc = "direct dependencies on kernel packages, as label strings"),
    },
    doc = "Fails at analysis when its deps or data reach more than one kernel tree (see the module docstring).",
)

def _split_direct(labels):
    """(labels of kernel packages, the other labels); a select() is walked whole, as the second."""
    if type(labels) != "list":
        return [], labels
    return [l for l in labels if tree_of(l)], [l for l in labels if not tree_of(l)]

def with_one_tree_check(name, kwargs, testonly = False):
    """kwargs for the py rule `name`, with its `<name>.one_tree` check declared and added to its data (unchanged
    when it has neither deps nor data: nothing to check)."""
    deps = kwargs.get("deps") or []
    data = kwargs.get("data") or []
    if not deps and not data:
        return kwargs
    direct, deps = _split_direct(deps)

    # A tree's own labels in data are left out: its files are files, and its packages are visible to the shim only
    # (Bazel refuses them anywhere else, in the target's name).
    _, data = _split_direct(data)
    one_tree_check(
        name = name + SUFFIX,
        deps = deps,
        data = data,
        direct = direct,
        testonly = kwargs.get("testonly", testonly),
        # A manual target's check is manual too: `bazel build //...` skips both.
        tags = [t for t in kwargs.get("tags", []) if t == "manual"],
        visibility = ["//visibility:private"],
    )
    out = dict(kwargs)
    out["data"] = kwargs.get("data", []) + [":" + name + SUFFIX]
    return out
