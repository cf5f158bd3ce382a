"""Pins of the CuTe DSL MegaMoE kernel drops: one external repository per kernel tree.

Carrier: the flashinfer-python wheel (Apache-2.0), resolved through pip's own index configuration.
SHA256 is the sha256 of that wheel file. Each tree is pinned on its own so that Hopper and
Blackwell can move to a new drop independently.

Update recipe (one pin = one VERSION line + one SHA256 line; tools/drop rewrites exactly these):
  bazel run //tools:drop -- bump --tree sm90 --version X   # or edit the two lines, then
  bazel run //third_party/cutedsl_megamoe:manifest -- --write sm90

These constants are the defaults of megamoe_ep_repositories() (//:repositories.bzl); an engine
pins its own drop through that macro's sm90_* / sm100_* arguments instead of editing this file.
"""

load("//third_party/cutedsl_megamoe:drop_repo.bzl", "cutedsl_megamoe_drop")

# Hopper (sm90): flashinfer/moe_ep/kernel_src/sm90/pull_style_cutedsl_megakernel/src/
SM90_VERSION = "0.7.4"
SM90_SHA256 = "a051a62e09a2738e8b0de47a1944fd2f0f3eff01b728b662141ea660cb09dd32"

# Blackwell (sm100): flashinfer/moe_ep/kernel_src/sm100/cutedsl_megamoe/src/
SM100_VERSION = "0.7.4"
SM100_SHA256 = "a051a62e09a2738e8b0de47a1944fd2f0f3eff01b728b662141ea660cb09dd32"

SM90_STRIP_PREFIX = "flashinfer/moe_ep/kernel_src/sm90/pull_style_cutedsl_megakernel/src"
SM100_STRIP_PREFIX = "flashinfer/moe_ep/kernel_src/sm100/cutedsl_megamoe/src"

def _pick(value, default):
    return default if value == None else value

def _pinned_by(version):
    """Whose pin a tree's is, for the fetch's error messages (drop_repo.bzl): this repository's own build, an
    engine's own pin, or an engine on this repository's pin."""
    if Label("//third_party/cutedsl_megamoe:workspace.bzl").workspace_name == "":
        return "megamoe_ep"
    return "default" if version == None else "consumer"

def repo(
        sm90_version = None,
        sm90_sha256 = None,
        sm90_strip_prefix = None,
        sm90_manifest = None,
        sm100_version = None,
        sm100_sha256 = None,
        sm100_strip_prefix = None,
        sm100_manifest = None):
    """Declares @cutedsl_megamoe_sm90 and @cutedsl_megamoe_sm100.

    Called by megamoe_ep_repositories() (//:repositories.bzl), which passes a consumer's own pins
    through; None takes this file's pin. The BUILD files and the default manifests are Label()s
    of this repository, so they resolve from any workspace.
    """
    cutedsl_megamoe_drop(
        name = "cutedsl_megamoe_sm90",
        tree = "sm90",
        version = _pick(sm90_version, SM90_VERSION),
        sha256 = _pick(sm90_sha256, SM90_SHA256),
        strip_prefix = _pick(sm90_strip_prefix, SM90_STRIP_PREFIX),
        build_file = Label("//third_party/cutedsl_megamoe:sm90.BUILD"),
        manifest = _pick(sm90_manifest, Label("//third_party/cutedsl_megamoe:sm90.manifest.json")),
        pinned_by = _pinned_by(sm90_version),
        default_version = SM90_VERSION,
    )
    cutedsl_megamoe_drop(
        name = "cutedsl_megamoe_sm100",
        tree = "sm100",
        version = _pick(sm100_version, SM100_VERSION),
        sha256 = _pick(sm100_sha256, SM100_SHA256),
        strip_prefix = _pick(sm100_strip_prefix, SM100_STRIP_PREFIX),
        build_file = Label("//third_party/cutedsl_megamoe:sm100.BUILD"),
        manifest = _pick(sm100_manifest, Label("//third_party/cutedsl_megamoe:sm100.manifest.json")),
        pinned_by = _pinned_by(sm100_version),
        default_version = SM100_VERSION,
    )
