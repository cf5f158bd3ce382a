"""source_digest: a file that changes exactly when the source tree does, for the tests whose input is all of it.

A test that reads the whole workspace (a nested Bazel over every BUILD file, a scan of every source) cannot list
its inputs, and tagged `external` it reran on every `bazel test //...`. With this file among its data it is cached
like any other test: the file holds the digest tools/bazel/workspace_status.sh computes at the start of every
build (Bazel's stable workspace status), so its content, and the test's cache key with it, changes when and only
when some source file does.
"""

_KEY = "STABLE_MOE_EP_SOURCE_DIGEST"

def _impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".txt")
    ctx.actions.run_shell(
        inputs = [ctx.info_file],
        outputs = [out],
        command = "grep '^%s ' \"$1\" > \"$2\" || { echo '%s: no %s line in the workspace status; is " % (
            _KEY,
            ctx.label,
            _KEY,
        ) + "--workspace_status_command=tools/bazel/workspace_status.sh in .bazelrc?' >&2; exit 1; }",
        arguments = [ctx.info_file.path, out.path],
        mnemonic = "SourceDigest",
        progress_message = "Source digest",
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

source_digest = rule(
    implementation = _impl,
    doc = "The source tree's digest from the stable workspace status (see the module docstring).",
)
