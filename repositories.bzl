"""The one entry point for every workspace that builds moe_ep: this one and an engine's.

In an engine's WORKSPACE (the repository must be named `megamoe_ep`: the BUILD files applied to the
kernel drops and the Python environment refer to `@megamoe_ep//...`):

    local_repository(name = "megamoe_ep", path = "/path/to/megamoe-ep")   # or http_archive(...)

    load("@megamoe_ep//:repositories.bzl", "megamoe_ep_repositories")

    megamoe_ep_repositories()

and one line in its .bazelrc (the offline stand-in for @remote_coverage_tools, needed by tests):

    build --coverage_report_generator=@megamoe_ep//tools/bazel/coverage_stub:coverage_report_generator

This repository's own WORKSPACE calls the same macro. It declares:
  - @rules_cc, @rules_java: offline stand-ins (tools/bazel/OFFLINE.md), unless already declared;
  - @moe_ep_python: the venv built from a hash-pinned lock, registered as the Python toolchain;
  - @cutedsl_megamoe_sm90, @cutedsl_megamoe_sm100: the kernel drops, each fetched by hash and
    checked file by file against its manifest (third_party/cutedsl_megamoe/drop_repo.bzl).

Every label here is a Label() of this repository, so it resolves the same from any workspace.
Labels a consumer passes (its own manifest, its own lock) are read against its own workspace.
"""

load("//third_party/cutedsl_megamoe:workspace.bzl", _cutedsl_megamoe = "repo")
load("//tools/bazel:offline.bzl", "local_stub_repository")
load("//tools/bazel:python_env.bzl", "python_env")

# The name consumers must give this repository (this repository's own workspace(name = ...)).
REPOSITORY_NAME = "megamoe_ep"

# The repositories this macro declares; a consumer must not declare them itself.
PYTHON_REPOSITORY = "moe_ep_python"

def _check_own_name():
    # In this repository's own WORKSPACE the label is in the main repository (workspace_name "");
    # in a consumer's it is in whatever name the consumer gave us.
    name = Label("//:repositories.bzl").workspace_name
    if name not in ("", REPOSITORY_NAME):
        fail(("megamoe_ep_repositories: this repository is declared as @%s, but it must be named " +
              "@%s (the BUILD files of the kernel drops and of @%s refer to @%s//...). Declare it as " +
              "local_repository(name = \"%s\", ...) or http_archive(name = \"%s\", ...).") % (
            name,
            REPOSITORY_NAME,
            PYTHON_REPOSITORY,
            REPOSITORY_NAME,
            REPOSITORY_NAME,
            REPOSITORY_NAME,
        ))

def _stub(name):
    # Bazel's own WORKSPACE suffix declares rules_cc / rules_java with maybe(), after the user's
    # WORKSPACE, so these win; a consumer that already has real ones keeps them.
    if native.existing_rule(name) == None:
        local_stub_repository(
            name = name,
            anchor = Label("//tools/bazel:OFFLINE.md"),
            directory = name + "_stub",
        )

def megamoe_ep_repositories(
        sm90_version = None,
        sm90_sha256 = None,
        sm90_strip_prefix = None,
        sm90_manifest = None,
        sm100_version = None,
        sm100_sha256 = None,
        sm100_strip_prefix = None,
        sm100_manifest = None,
        requirements_lock = None,
        register_python_toolchain = True):
    """Declares everything moe_ep needs; every argument is optional.

    Args:
      sm90_version: flashinfer-python version carrying the Hopper tree (default: this repo's pin,
        SM90_VERSION in third_party/cutedsl_megamoe/workspace.bzl). Give sm90_sha256 with it.
      sm90_sha256: sha256 of that wheel file.
      sm90_strip_prefix: the tree's path inside the wheel (default SM90_STRIP_PREFIX).
      sm90_manifest: label of the per-file manifest of that tree (default: this repo's
        third_party/cutedsl_megamoe/sm90.manifest.json). A pin whose sha256 differs from the
        manifest's carrier_sha256 fails the fetch and prints how to generate a manifest.
      sm100_version: as sm90_version, for the Blackwell tree.
      sm100_sha256: as sm90_sha256.
      sm100_strip_prefix: as sm90_strip_prefix.
      sm100_manifest: as sm90_manifest.
      requirements_lock: label of a hash-pinned lock (pip-compile --generate-hashes) to build
        @moe_ep_python from, instead of this repo's //:requirements.lock. It must pin at least
        what this repo's requirements.in asks for; add your own packages to it.
      register_python_toolchain: register @moe_ep_python//:toolchain (True). Pass False only if
        you register it yourself: moe_ep needs that interpreter.
    """
    _check_own_name()
    for tree, version, sha256 in (("sm90", sm90_version, sm90_sha256), ("sm100", sm100_version, sm100_sha256)):
        if (version == None) != (sha256 == None):
            fail(("megamoe_ep_repositories: give %s_version and %s_sha256 together (a version is " +
                  "accepted only with the sha256 of its wheel; got version %r, sha256 %r)") % (
                tree,
                tree,
                version,
                sha256,
            ))

    _stub("rules_cc")
    _stub("rules_java")

    python_env(
        name = PYTHON_REPOSITORY,
        requirements = requirements_lock if requirements_lock != None else Label("//:requirements.lock"),
    )
    if register_python_toolchain:
        native.register_toolchains("@%s//:toolchain" % PYTHON_REPOSITORY)

    _cutedsl_megamoe(
        sm90_version = sm90_version,
        sm90_sha256 = sm90_sha256,
        sm90_strip_prefix = sm90_strip_prefix,
        sm90_manifest = sm90_manifest,
        sm100_version = sm100_version,
        sm100_sha256 = sm100_sha256,
        sm100_strip_prefix = sm100_strip_prefix,
        sm100_manifest = sm100_manifest,
    )
