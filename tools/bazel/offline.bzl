"""Repository rule for the offline stand-ins (tools/bazel/OFFLINE.md), usable from any workspace.

`local_repository(path = "tools/bazel/rules_cc_stub")` only works in this repository's own
WORKSPACE: a relative path is read against the *main* workspace, which is the consumer's when
megamoe_ep is an external repository. This rule finds the stub next to a label instead
(`Label("//tools/bazel:OFFLINE.md")`, resolved against the repository this file lives in) and
links the stub directory's top-level entries into the new repository.

The anchor is a file of //tools/bazel, not one inside the stub: //:.bazelignore takes the stub
directories out of this workspace, so in this repository's own build a label inside
tools/bazel/rules_cc_stub/ reads "Package is considered deleted due to --deleted_packages".
"""

def _local_stub_repository_impl(ctx):
    root = ctx.path(ctx.attr.anchor).dirname.get_child(ctx.attr.directory)
    if not root.get_child("WORKSPACE").exists:
        fail("local_stub_repository(%s): no WORKSPACE in %s" % (ctx.name, root))
    for entry in root.readdir():
        ctx.symlink(entry, entry.basename)

local_stub_repository = repository_rule(
    implementation = _local_stub_repository_impl,
    attrs = {
        "anchor": attr.label(
            mandatory = True,
            allow_single_file = True,
            doc = "a file in the directory that holds the stub",
        ),
        "directory": attr.string(mandatory = True, doc = "the stub's directory, next to `anchor`"),
    },
    doc = "A directory of this repository (found by label) as an external repository of its own.",
)
