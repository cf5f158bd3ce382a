"""Repository rule: one sub-tree of a CuTe DSL MegaMoE kernel drop, fetched by hash.

The drops ship inside the `flashinfer-python` wheel (the carrier). The rule gives http_archive's
guarantees for a file that is resolved by pip instead of by URL:

  1. find the carrier: first in Bazel's repository cache (content-addressed by the pinned
     sha256, so a wheel verified once on this machine is reused with no network at all), else
     `python3 -m pip download --no-deps --only-binary=:all: flashinfer-python==VERSION`. pip reads
     its own index configuration (pip.conf, PIP_* variables): no registry host is written here;
  2. hash the wheel and compare with the pin BEFORE anything is extracted; a mismatch fails the
     build and prints both hashes and the update recipe;
  3. extract only `strip_prefix` (one kernel tree) as the repository root;
  4. check the tree against its per-file manifest (`manifest`, by default this repository's
     third_party/cutedsl_megamoe/<tree>.manifest.json): the manifest must describe this very
     carrier (its carrier_sha256 is the pin), and every extracted file must match it, no file
     more, no file less (third_party/cutedsl_megamoe/manifest.py --tree-root --against, run
     with the base python). A pin without a matching manifest fails and says how to make one;
  5. add the BUILD file (sm90.BUILD / sm100.BUILD), `carrier.json` (what was fetched) and
     `pinned.manifest.json` (the manifest's content: the shim checks the tree against it at
     load time, so it travels with the tree into runfiles).

The pins themselves live in workspace.bzl and reach this rule through megamoe_ep_repositories()
(//:repositories.bzl), which lets a consumer pass its own. Every default label here is a Label()
of this repository, so the rule works from any workspace. The drop's files are never edited.
"""

CARRIER = "flashinfer-python"

# Files this rule adds at the repository root. Everything else in the repository is the drop,
# byte for byte; manifest.py leaves these out of the per-file manifest.
ADDED_FILES = ["BUILD.bazel", "WORKSPACE", "carrier.json", "pinned.manifest.json"]

# The manifest format's one definition; run with the base python at fetch time.
_MANIFEST_TOOL = Label("//third_party/cutedsl_megamoe:manifest.py")

_RECIPE = """To take a new drop on purpose, update the pin and the manifest together:
  bazel run //tools:drop -- bump --tree {tree} --version NEW_VERSION
or by hand: set {tree_upper}_VERSION / {tree_upper}_SHA256 in third_party/cutedsl_megamoe/workspace.bzl
(sha256 of the wheel: `python3 -m pip download --no-deps --only-binary=:all: {carrier}==NEW_VERSION -d /tmp/w
&& sha256sum /tmp/w/*.whl`), then `bazel run //third_party/cutedsl_megamoe:manifest -- --write {tree}`."""

_MANIFEST_RECIPE = """Generate the manifest of this pin (it fetches the wheel by this hash and hashes every file of the tree):
  bazel run @megamoe_ep//tools:drop -- manifest --tree {tree} --version {version} --sha256 {sha256} --out <path>
Run it where the drop repositories still fetch: the tool carries them, so in the workspace whose pin
fails here it cannot build; in a megamoe-ep checkout it is `bazel run //tools:drop -- manifest` with
the same flags. Then pass the file to megamoe_ep_repositories(..., {tree}_manifest = "//<package>:<file>")
next to the pin, or, in megamoe-ep itself, write it to third_party/cutedsl_megamoe/{tree}.manifest.json."""

# An engine's own pin (megamoe_ep_repositories(<tree>_version = ..., <tree>_sha256 = ...) in its WORKSPACE): what to
# change is in that WORKSPACE, never in megamoe-ep's files.
_CONSUMER_RECIPE = """The pin is yours: megamoe_ep_repositories({tree}_version = "{version}", {tree}_sha256 = "...") in your
WORKSPACE. Put the sha256 of the wheel you mean there:
  python3 -m pip download --no-deps --only-binary=:all: {carrier}=={version} -d /tmp/w && sha256sum /tmp/w/*.whl
A version other than megamoe-ep's own ({default_version}) also needs {tree}_manifest = "//<package>:<file>"
(the fetch says how to write one). Or drop the three {tree}_* arguments to take megamoe-ep's pin."""

# An engine on megamoe-ep's default pin: nothing of its own to fix.
_DEFAULT_PIN_RECIPE = """This is megamoe-ep's own pin ({default_version}; your WORKSPACE passes no {tree}_version / {tree}_sha256): do
not edit megamoe-ep's files. If pip resolved a different file on purpose (a mirror), pin that wheel yourself:
megamoe_ep_repositories({tree}_version = ..., {tree}_sha256 = ..., {tree}_manifest = ...) in your WORKSPACE."""

def _recipe(ctx):
    fields = dict(
        tree = ctx.attr.tree,
        tree_upper = ctx.attr.tree.upper(),
        carrier = CARRIER,
        version = ctx.attr.version,
        default_version = ctx.attr.default_version,
    )
    if ctx.attr.pinned_by == "consumer":
        return _CONSUMER_RECIPE.format(**fields)
    if ctx.attr.pinned_by == "default":
        return _DEFAULT_PIN_RECIPE.format(**fields)
    return _RECIPE.format(**fields)

def _fail(ctx, what, message):
    """Prints `message` once, then fails with one line. Bazel repeats a failed fetch's fail() text for every target
    that depends on the repository (seven copies of a 20-line box for one wrong pin), so the box goes to the output
    once, here, and each repeat is a single line."""
    ctx.execute(["/bin/sh", "-c", "printf '%s\\n' \"$1\" >&2", "sh", message], quiet = False)
    fail("cutedsl_megamoe_drop(%s): %s; the reason and what to change are printed above." % (ctx.attr.tree, what))

def _manifest_recipe(ctx):
    return _MANIFEST_RECIPE.format(tree = ctx.attr.tree, version = ctx.attr.version, sha256 = ctx.attr.sha256)

def _manifest_label(ctx):
    if ctx.attr.manifest:
        return ctx.attr.manifest
    return Label("//third_party/cutedsl_megamoe:%s.manifest.json" % ctx.attr.tree)

def _build_file_label(ctx):
    if ctx.attr.build_file:
        return ctx.attr.build_file
    return Label("//third_party/cutedsl_megamoe:%s.BUILD" % ctx.attr.tree)

def _find_python(ctx):
    explicit = ctx.os.environ.get("MOE_EP_PYTHON")
    if explicit:
        return ctx.path(explicit) if explicit.startswith("/") else ctx.which(explicit)
    for name in ["python3.11", "python3"]:
        found = ctx.which(name)
        if found:
            return found
    fail("cutedsl_megamoe_drop: no python3 on PATH (needed to run `pip download`); set MOE_EP_PYTHON")

def _canonical_id(ctx):
    # Cache hits are restricted to entries stored under the same id: the pinned version.
    return "%s==%s" % (CARRIER, ctx.attr.version)

def _sha256_of(ctx, path):
    """The sha256 of the file at `path`, by the base python (ctx.download of a file with no expected hash would
    do it too, but prints an `INFO: SHA256 ...` line for every call: noise on a pinned fetch)."""
    res = ctx.execute([
        _find_python(ctx),
        "-c",
        "import hashlib, sys\nh = hashlib.sha256()\nwith open(sys.argv[1], 'rb') as f:\n" +
        "    for b in iter(lambda: f.read(1 << 20), b''):\n        h.update(b)\nprint(h.hexdigest())",
        str(path),
    ], timeout = 600)
    if res.return_code != 0:
        fail("cutedsl_megamoe_drop(%s): cannot hash %s:\n%s" % (ctx.attr.tree, path, res.stderr))
    return res.stdout.strip()

def _fetch_carrier(ctx, carrier_zip):
    """Puts the pinned wheel at `carrier_zip` (named .zip so that extract() treats it as one)."""
    want = ctx.attr.sha256

    # 1. Repository cache, by hash and version alone. No URL, so that a miss is success = False with nothing
    #    printed: a URL that fails makes Bazel print a "WARNING: Download from ... failed" line.
    cached = ctx.download(
        url = [],
        output = carrier_zip,
        sha256 = want,
        canonical_id = _canonical_id(ctx),
        allow_fail = True,
    )
    if cached.success:
        return "repository cache"

    # 2. pip, with pip's own configuration.
    ctx.report_progress("pip download %s==%s" % (CARRIER, ctx.attr.version))
    python = _find_python(ctx)
    dest = ctx.path("_carrier")
    # quiet = False: pip's lines reach Bazel's output (a log or CI, too: no progress bar).
    res = ctx.execute(
        [
            python,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--no-input",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            "--dest",
            str(dest),
            "%s==%s" % (CARRIER, ctx.attr.version),
        ],
        timeout = 1800,
        quiet = False,
    )
    if res.return_code != 0:
        _fail(ctx, "`pip download %s==%s` failed" % (CARRIER, ctx.attr.version), "cutedsl_megamoe_drop(%s): `pip download %s==%s` failed (exit %d):\n%s\n%s" % (
            ctx.attr.tree,
            CARRIER,
            ctx.attr.version,
            res.return_code,
            res.stdout,
            res.stderr,
        ))
    wheels = [f for f in dest.readdir() if f.basename.endswith(".whl")]
    if len(wheels) != 1:
        fail("cutedsl_megamoe_drop(%s): expected exactly one wheel from pip, got %s" % (
            ctx.attr.tree,
            [f.basename for f in dest.readdir()],
        ))

    # 3. Verify before anything is extracted.
    got = _sha256_of(ctx, wheels[0])
    if got != want:
        _fail(ctx, "the wheel pip resolved is not the pinned one (sha256 %s, pinned %s)" % (got, want), """
================================================================================
cutedsl_megamoe_drop(%s): CARRIER HASH MISMATCH, nothing was extracted.
  carrier:  %s==%s (%s)
  pinned:   sha256 %s
  received: sha256 %s
The file pip resolved is not the pinned drop. If the pin is right, stop: the index served
different bytes under the same version.
%s
================================================================================""" % (
            ctx.attr.tree,
            CARRIER,
            ctx.attr.version,
            wheels[0].basename,
            want,
            got,
            _recipe(ctx),
        ))

    # Verified: copy it into place and into the repository cache (by its hash, under the version), so the next
    # fetch needs no network. The expected hash given, Bazel prints nothing.
    ctx.download(
        url = "file://" + str(wheels[0]),
        output = carrier_zip,
        sha256 = want,
        canonical_id = _canonical_id(ctx),
    )
    ctx.delete("_carrier")
    return "pip: " + wheels[0].basename

def _check_manifest(ctx, carrier_sha256):
    """Steps 4 and 5: the manifest describes this carrier and every extracted file. Returns its text."""
    label = _manifest_label(ctx)
    path = ctx.path(label)
    text = ctx.read(path)
    manifest = json.decode(text)
    pinned_for = manifest.get("carrier_sha256")
    if pinned_for != carrier_sha256:
        _fail(ctx, "no manifest for this pin", """
================================================================================
cutedsl_megamoe_drop(%s): NO MANIFEST FOR THIS PIN.
  pin:      %s==%s, sha256 %s
  manifest: %s describes %s==%s, sha256 %s
Every drop tree is checked file by file against a manifest of that exact carrier.
%s
================================================================================""" % (
            ctx.attr.tree,
            CARRIER,
            ctx.attr.version,
            carrier_sha256,
            label,
            CARRIER,
            manifest.get("version"),
            pinned_for,
            _manifest_recipe(ctx),
        ))

    ctx.report_progress("checking every file of the %s tree against %s" % (ctx.attr.tree, label))
    res = ctx.execute(
        [_find_python(ctx), ctx.path(_MANIFEST_TOOL), "--tree-root", ctx.path("."), "--against", path],
        timeout = 600,
    )
    if res.return_code != 0:
        _fail(ctx, "the extracted tree does not match its manifest", """
================================================================================
cutedsl_megamoe_drop(%s): THE EXTRACTED TREE DOES NOT MATCH ITS MANIFEST.
  carrier:  %s==%s, sha256 %s (the hash matched the pin)
  manifest: %s
%s%s
The drop is consumed verbatim. A manifest that does not describe the carrier it names is wrong:
regenerate it from the pinned carrier. %s
================================================================================""" % (
            ctx.attr.tree,
            CARRIER,
            ctx.attr.version,
            carrier_sha256,
            label,
            res.stdout,
            res.stderr,
            _manifest_recipe(ctx),
        ))
    return text

def _cutedsl_megamoe_drop_impl(ctx):
    # Every label first: resolving one later restarts the rule from the top (Bazel 4), and a message already
    # printed would be printed again.
    ctx.path(_manifest_label(ctx))
    ctx.path(_build_file_label(ctx))
    ctx.path(_MANIFEST_TOOL)

    carrier_zip = "_carrier.zip"
    source = _fetch_carrier(ctx, carrier_zip)

    # The hash is known good here: (re)compute it on the exact bytes being extracted anyway, so
    # a corrupted repository-cache entry cannot slip through.
    got = _sha256_of(ctx, ctx.path(carrier_zip))
    if got != ctx.attr.sha256:
        _fail(ctx, "the carrier's sha256 is not the pin's", "cutedsl_megamoe_drop(%s): carrier sha256 %s != pinned %s (from %s).\n%s" % (
            ctx.attr.tree,
            got,
            ctx.attr.sha256,
            source,
            _recipe(ctx),
        ))

    ctx.report_progress("extracting %s" % ctx.attr.strip_prefix)
    ctx.extract(carrier_zip, stripPrefix = ctx.attr.strip_prefix)
    ctx.delete(carrier_zip)

    for name in ADDED_FILES:
        if ctx.path(name).exists:
            fail("cutedsl_megamoe_drop(%s): the drop itself has a top-level %s; this rule would " % (
                ctx.attr.tree,
                name,
            ) + "overwrite it. Rename the rule's added files in drop_repo.bzl and manifest.py.")

    manifest_text = _check_manifest(ctx, got)

    ctx.template("BUILD.bazel", _build_file_label(ctx), executable = False)
    ctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % ctx.name, executable = False)
    ctx.file("carrier.json", json.encode_indent({
        "carrier": CARRIER,
        "carrier_sha256": got,
        "fetched_from": source.split(":")[0],
        "repository": ctx.name,
        "strip_prefix": ctx.attr.strip_prefix,
        "tree": ctx.attr.tree,
        "version": ctx.attr.version,
    }) + "\n", executable = False)
    ctx.file("pinned.manifest.json", manifest_text, executable = False)

cutedsl_megamoe_drop = repository_rule(
    implementation = _cutedsl_megamoe_drop_impl,
    attrs = {
        "default_version": attr.string(doc = "megamoe-ep's own pin of this tree, for the error messages"),
        "pinned_by": attr.string(
            default = "megamoe_ep",
            values = ["megamoe_ep", "consumer", "default"],
            doc = "whose pin this is, for the error messages: megamoe-ep's own build (megamoe_ep), an engine's " +
                  "megamoe_ep_repositories(<tree>_version/_sha256) (consumer), or an engine on megamoe-ep's pin " +
                  "(default)",
        ),
        "build_file": attr.label(
            allow_single_file = True,
            doc = "BUILD file of the tree (default: this repository's third_party/cutedsl_megamoe/<tree>.BUILD)",
        ),
        "manifest": attr.label(
            allow_single_file = True,
            doc = "per-file manifest of the tree (default: this repository's " +
                  "third_party/cutedsl_megamoe/<tree>.manifest.json); its carrier_sha256 must be the pin",
        ),
        "sha256": attr.string(mandatory = True, doc = "sha256 of the carrier wheel"),
        "strip_prefix": attr.string(mandatory = True, doc = "the one sub-tree of the wheel to keep"),
        "tree": attr.string(mandatory = True, values = ["sm90", "sm100"]),
        "version": attr.string(mandatory = True, doc = "flashinfer-python version"),
    },
    environ = ["MOE_EP_PYTHON"],
    doc = "One kernel tree of a CuTe DSL MegaMoE drop, from the pinned flashinfer-python wheel.",
)
