"""Load-time integrity of a kernel tree (shim/common/tree.py), on small stand-in trees.

A stand-in tree has the Hopper tree's top-level package names and a manifest made from its files; the pin
directory tree.py reads committed manifests from is pointed at a temp dir in-process. Each case starts from a
fresh guard state (the `fresh` fixture resets tree.py's process state and restores sys.path, sys.meta_path and
sys.modules after), so no case sees another's tree. The real trees are covered by
tests/shim/sm100/tree_guard_test.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import types
import warnings
from pathlib import Path

import pytest

from moe_ep.errors import BackendUnavailableError, MoEError
from shim.common import integrity, lazy, tree
from shim.common.tree import TreeConflictError, TreeIntegrityError, TreeNotFoundError, UnpinnedTreeWarning

ENV = "MOE_EP_SM90_TREE"
REPO = "cutedsl_megamoe_sm90"
FILES = {
    "common/__init__.py": "WHICH = 'common'\n",
    "common/megamoe_constants.py": "SfPaddingBlock = 128\n",
    "src/__init__.py": "",
    "src/sym_buffer.py": "class SymBufferHost:\n    pass\n",
    "moe_hopper_fp8/__init__.py": "",
    "moe_hopper_fp8/heuristic_config.py": "HEURISTIC_CONFIGS = {}\n",
    "moe_hopper_bf16/__init__.py": "",
    "moe_nvfp4_swapab/__init__.py": "",
    "moe_nvfp4_swapab/data/table.bin": "\x00\x01binary-ish",
}


def _write(root: Path, files=FILES) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def _manifest(files=FILES, version="9.9.9") -> dict:
    return {"version": version, "carrier_sha256": "c" * 64,
            "files": {rel: hashlib.sha256(text.encode()).hexdigest() for rel, text in sorted(files.items())}}


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """tree.py as in a new process, its committed pins read from tmp_path/pins (sm90 = FILES)."""
    for var in ("MOE_EP_SM90_TREE", "MOE_EP_SM100_TREE", "MOE_EP_UNPINNED_TREE", "RUNFILES_DIR", "TEST_SRCDIR",
                "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    pins = tmp_path / "pins"
    pins.mkdir()
    (pins / "sm90.manifest.json").write_text(json.dumps(_manifest()), encoding="utf-8")
    saved_path, saved_meta = list(sys.path), list(sys.meta_path)
    saved_mods = {k: v for k, v in sys.modules.items() if k.partition(".")[0] in tree.KERNEL_NAMES}
    state = (tree._active, dict(tree._provenance), dict(tree._hashed), tree._guard, tree._PIN_DIRS)
    tree._active, tree._provenance, tree._hashed, tree._guard = None, {}, {}, None
    tree._PIN_DIRS = [str(pins)]
    sys.path[:] = [p for p in sys.path if os.path.basename(os.path.normpath(p or ".")) not in (REPO, "cutedsl_megamoe_sm100")]
    for name in list(sys.modules):
        if name.partition(".")[0] in tree.KERNEL_NAMES:
            del sys.modules[name]
    yield pins
    for name in list(sys.modules):
        if name.partition(".")[0] in tree.KERNEL_NAMES:
            del sys.modules[name]
    sys.modules.update(saved_mods)
    sys.path[:] = saved_path
    sys.meta_path[:] = saved_meta
    tree._active, tree._provenance, tree._hashed, tree._guard, tree._PIN_DIRS = (
        state[0], state[1], state[2], state[3], state[4])


def _bazel_tree(tmp_path: Path, files=FILES, pinned=None) -> Path:
    """A tree laid out like the Bazel drop repository in the runfiles, on sys.path (as imports=["."] does)."""
    root = _write(tmp_path / "runfiles" / REPO, files)
    (root / "BUILD.bazel").write_text("# added by the repository rule\n")
    if pinned is not None:
        (root / integrity.PINNED_MANIFEST).write_text(json.dumps(pinned), encoding="utf-8")
    sys.path.append(str(root))
    return root


# ---------------------------------------------------------------------------------------------------- hashing


def test_digests_cover_every_file_but_bytecode_and_added_files(tmp_path):
    root = _write(tmp_path / "t")
    (root / "moe_hopper_fp8" / "__pycache__").mkdir()
    (root / "moe_hopper_fp8" / "__pycache__" / "heuristic_config.cpython-311.pyc").write_bytes(b"junk")
    (root / "stray.pyc").write_bytes(b"junk")
    for added in integrity.ADDED_FILES:
        (root / added).write_text("x")
    assert integrity.tree_digests(str(root)) == _manifest()["files"]
    (root / "moe_hopper_fp8" / "notes.txt").write_text("x")  # any other file counts, .py or not
    assert "moe_hopper_fp8/notes.txt" in integrity.tree_digests(str(root))


# -------------------------------------------------------------------------------------------- env-var trees


def test_env_tree_matching_the_committed_pin_loads(fresh, tmp_path, monkeypatch):
    root = _write(tmp_path / "extracted" / "src")
    monkeypatch.setenv(ENV, str(root))
    assert tree.activate("sm90") == str(root)
    prov = tree.tree_provenance("sm90")
    assert prov["verified"] is True and prov["unpinned"] is False and prov["source"] == ENV
    assert prov["manifest_version"] == "9.9.9" and prov["files"] == len(FILES) and prov["check_ms"] >= 0
    assert prov["manifests"] == [str(fresh / "sm90.manifest.json")]
    import common.megamoe_constants as c

    assert c.__file__.startswith(str(root))


@pytest.mark.parametrize("edit, kind, name", [
    (lambda r: (r / "moe_hopper_fp8" / "heuristic_config.py").write_text("HEURISTIC_CONFIGS = {'x': 1}\n"),
     "changed", "moe_hopper_fp8/heuristic_config.py"),
    (lambda r: (r / "moe_hopper_fp8" / "extra.py").write_text("import os\n"), "added", "moe_hopper_fp8/extra.py"),
    (lambda r: (r / "src" / "sym_buffer.py").unlink(), "removed", "src/sym_buffer.py"),
    (lambda r: (r / "moe_nvfp4_swapab" / "data" / "table.bin").write_bytes(b"\x00"), "changed",
     "moe_nvfp4_swapab/data/table.bin"),
])
def test_env_tree_that_differs_from_the_pin_is_refused(fresh, tmp_path, monkeypatch, edit, kind, name):
    root = _write(tmp_path / "extracted" / "src")
    edit(root)
    monkeypatch.setenv(ENV, str(root))
    with pytest.raises(TreeIntegrityError) as info:
        tree.activate("sm90")
    err = info.value
    assert isinstance(err, BackendUnavailableError) and isinstance(err, MoEError)
    assert err.argument == ENV
    text = str(err)
    assert f"{kind}: {name}" in text and "MOE_EP_UNPINNED_TREE=sm90" in text and "clean extraction" in text
    assert tree.active_tree() is None and str(root) not in sys.path
    assert "common" not in sys.modules


def test_unpinned_opt_in_loads_with_a_warning_and_a_record(fresh, tmp_path, monkeypatch, capsys):
    root = _write(tmp_path / "mine")
    (root / "moe_hopper_fp8" / "heuristic_config.py").write_text("HEURISTIC_CONFIGS = {'tuned': 1}\n")
    monkeypatch.setenv(ENV, str(root))
    monkeypatch.setenv("MOE_EP_UNPINNED_TREE", "sm90")
    monkeypatch.setenv("RANK", "3")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tree.activate("sm90") == str(root)
    assert [w.category for w in caught] == [UnpinnedTreeWarning]
    err = capsys.readouterr().err
    assert "[rank 3] UNPINNED sm90 kernel tree" in err and "changed: moe_hopper_fp8/heuristic_config.py" in err
    prov = tree.tree_provenance()
    assert prov["unpinned"] is True and prov["verified"] is False
    assert prov["mismatch"] == ["moe_hopper_fp8/heuristic_config.py"]
    import moe_hopper_fp8.heuristic_config as h

    assert h.HEURISTIC_CONFIGS == {"tuned": 1}


@pytest.mark.parametrize("value, loads", [("1", True), ("sm90", True), ("sm100,sm90", True), ("sm100", False),
                                          ("0", False)])
def test_opt_in_values(fresh, tmp_path, monkeypatch, value, loads):
    root = _write(tmp_path / "mine")
    (root / "src" / "new.py").write_text("")
    monkeypatch.setenv(ENV, str(root))
    monkeypatch.setenv("MOE_EP_UNPINNED_TREE", value)
    if loads:
        with pytest.warns(UnpinnedTreeWarning):
            tree.activate("sm90")
        assert tree.tree_provenance()["unpinned"] is True
    else:
        with pytest.raises(TreeIntegrityError):
            tree.activate("sm90")


def test_a_misspelt_opt_in_is_an_error_not_a_no(fresh, tmp_path, monkeypatch):
    root = _write(tmp_path / "mine")
    (root / "src" / "new.py").write_text("")
    monkeypatch.setenv(ENV, str(root))
    monkeypatch.setenv("MOE_EP_UNPINNED_TREE", "yes-sm9O")
    with pytest.raises(TreeIntegrityError) as info:
        tree.activate("sm90")
    assert info.value.argument == "MOE_EP_UNPINNED_TREE"


def test_no_pin_found_refuses_unless_opted_in(fresh, tmp_path, monkeypatch):
    tree._PIN_DIRS = [str(tmp_path / "nowhere")]
    monkeypatch.setenv(ENV, str(_write(tmp_path / "src")))
    with pytest.raises(TreeIntegrityError, match="no pinned manifest of the sm90 tree"):
        tree.activate("sm90")
    monkeypatch.setenv("MOE_EP_UNPINNED_TREE", "1")
    with pytest.warns(UnpinnedTreeWarning, match="could not be checked"):
        tree.activate("sm90")


def test_env_var_naming_no_tree_is_not_found(fresh, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    with pytest.raises(TreeNotFoundError) as info:
        tree.activate("sm90")
    assert info.value.argument == ENV and "moe_hopper_fp8/" in str(info.value)


def test_nothing_found(fresh):
    with pytest.raises(TreeNotFoundError) as info:
        tree.activate("sm90")
    assert isinstance(info.value, BackendUnavailableError) and info.value.argument == ENV


# -------------------------------------------------------------------------------------------- Bazel trees


def test_bazel_tree_checks_against_its_pinned_manifest_json(fresh, tmp_path):
    # A consumer's own pin: the repository carries its manifest; the checkout's committed one differs.
    consumer = dict(FILES, **{"src/sym_buffer.py": "class SymBufferHost:\n    consumer = True\n"})
    root = _bazel_tree(tmp_path, consumer, pinned=_manifest(consumer, version="8.0"))
    assert tree.activate("sm90") == str(root)
    prov = tree.tree_provenance()
    assert prov["source"] == "bazel" and prov["verified"] and prov["manifest_version"] == "8.0"
    assert prov["manifests"] == [str(root / integrity.PINNED_MANIFEST)]


def test_bazel_tree_without_pinned_manifest_falls_back_to_the_committed_one(fresh, tmp_path):
    root = _bazel_tree(tmp_path)
    assert tree.activate("sm90") == str(root)
    assert tree.tree_provenance()["manifests"] == [str(fresh / "sm90.manifest.json")]


def test_bazel_tree_edited_after_fetch_is_refused_with_the_refetch_recipe(fresh, tmp_path, monkeypatch):
    root = _bazel_tree(tmp_path, pinned=_manifest())
    (root / "moe_hopper_fp8" / "heuristic_config.py").write_text("HEURISTIC_CONFIGS = None\n")
    monkeypatch.setenv("MOE_EP_UNPINNED_TREE", "1")  # the opt-in is for env-var trees, not for an edited pin
    with pytest.raises(TreeIntegrityError) as info:
        tree.activate("sm90")
    text = str(info.value)
    assert info.value.argument == "tree"
    assert "changed: moe_hopper_fp8/heuristic_config.py" in text
    assert "bazel sync --only=cutedsl_megamoe_sm90" in text and "bazel clean --expunge" in text


def test_bazel_legacy_init_files_are_named_as_such_not_as_edits(fresh, tmp_path):
    # What py_binary / py_test write into the runfiles without --incompatible_default_to_explicit_init_py (or
    # legacy_create_init = False): an empty __init__.py in every directory that lacks one, the tree's root too.
    root = _bazel_tree(tmp_path, pinned=_manifest())
    for rel in ("__init__.py", "moe_nvfp4_swapab/data/__init__.py"):
        (root / rel).write_text("")
    with pytest.raises(TreeIntegrityError) as info:
        tree.activate("sm90")
    text = str(info.value)
    assert info.value.argument == "tree"
    assert "2 empty __init__.py file(s)" in text and "Bazel's legacy __init__.py" in text, text
    assert "--incompatible_default_to_explicit_init_py" in text and "@megamoe_ep//tools/bazel:py.bzl" in text
    assert "modified" not in text and "bazel sync" not in text


def test_legacy_init_files_beside_a_real_edit_are_an_edit(fresh, tmp_path):
    root = _bazel_tree(tmp_path, pinned=_manifest())
    (root / "__init__.py").write_text("")
    (root / "moe_hopper_fp8" / "heuristic_config.py").write_text("HEURISTIC_CONFIGS = None\n")
    with pytest.raises(TreeIntegrityError) as info:
        tree.activate("sm90")
    assert "Bazel's legacy" not in str(info.value) and "changed: moe_hopper_fp8/heuristic_config.py" in str(info.value)


def test_bazel_and_env_with_the_same_content_use_the_bazel_tree(fresh, tmp_path, monkeypatch):
    root = _bazel_tree(tmp_path, pinned=_manifest())
    env = _write(tmp_path / "extracted" / "src")
    sys.path.insert(0, str(env))  # even if the env tree was put on the path, only one root stays
    monkeypatch.setenv(ENV, str(env))
    assert tree.activate("sm90") == str(root)
    assert str(env) not in sys.path and str(root) in sys.path
    assert "same content" in tree.tree_provenance()["note"]
    import common

    assert common.__file__.startswith(str(root))


def test_bazel_and_a_different_env_tree_are_refused(fresh, tmp_path, monkeypatch):
    """Issue #14: `bazel test --config=hopper` with the README's env var exported loaded FP8 from the env tree and
    BF16 from the pinned one. Now the env tree must have the pinned content, or the run stops."""
    root = _bazel_tree(tmp_path, pinned=_manifest())
    older = {k: v for k, v in FILES.items() if not k.startswith("moe_hopper_bf16/")}  # an older drop, no BF16
    older["moe_hopper_fp8/heuristic_config.py"] = "HEURISTIC_CONFIGS = {'old': 1}\n"
    env = _write(tmp_path / "old" / "src", older)
    monkeypatch.setenv(ENV, str(env))
    with pytest.raises(TreeIntegrityError) as info:
        tree.activate("sm90")
    text = str(info.value)
    assert info.value.argument == ENV
    assert "removed: moe_hopper_bf16/__init__.py" in text and "Under Bazel the variable is not needed" in text
    assert str(root) in text and tree.active_tree() is None


def test_bazel_and_a_different_env_tree_opted_in_use_the_env_tree_alone(fresh, tmp_path, monkeypatch):
    root = _bazel_tree(tmp_path, pinned=_manifest())
    older = {k: v for k, v in FILES.items() if not k.startswith("moe_hopper_bf16/")}
    env = _write(tmp_path / "old" / "src", older)
    monkeypatch.setenv(ENV, str(env))
    monkeypatch.setenv("MOE_EP_UNPINNED_TREE", "sm90")
    with pytest.warns(UnpinnedTreeWarning, match="set aside"):
        assert tree.activate("sm90") == str(env)
    assert str(root) not in sys.path
    import moe_hopper_fp8

    assert moe_hopper_fp8.__file__.startswith(str(env))
    with pytest.raises(ModuleNotFoundError):  # not silently from the Bazel tree
        import moe_hopper_bf16  # noqa: F401


# ------------------------------------------------------------------------------------------- one root only


def test_a_kernel_module_from_a_second_root_is_refused(fresh, tmp_path, monkeypatch):
    root = _write(tmp_path / "one" / "src")
    monkeypatch.setenv(ENV, str(root))
    tree.activate("sm90")
    import common  # noqa: F401  (from the verified root)

    second = _write(tmp_path / "two" / "src")
    sys.path.insert(0, str(second))  # around the guard, after activation
    with pytest.raises(TreeConflictError) as info:
        import moe_hopper_bf16  # noqa: F401
    assert str(second) in str(info.value) and info.value.argument == "tree"
    with pytest.raises(TreeConflictError):
        import src.sym_buffer  # noqa: F401  (its package `src` resolves in the second root first)


def test_a_kernel_module_imported_before_activation_from_elsewhere_is_refused(fresh, tmp_path, monkeypatch):
    other = _write(tmp_path / "other" / "src")
    sys.path.insert(0, str(other))
    import common  # noqa: F401
    sys.path.remove(str(other))
    monkeypatch.setenv(ENV, str(_write(tmp_path / "one" / "src")))
    with pytest.raises(TreeConflictError, match=r"common \(from .*other"):
        tree.activate("sm90")


def test_a_module_slipped_into_sys_modules_after_activation_is_refused(fresh, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(_write(tmp_path / "one" / "src")))
    tree.activate("sm90")
    fake = types.ModuleType("common.megamoe_constants")
    fake.__file__ = str(tmp_path / "elsewhere" / "common" / "megamoe_constants.py")
    fake.SfPaddingBlock = 7
    sys.modules["common.megamoe_constants"] = fake
    with pytest.raises(TreeConflictError):
        tree.activate("sm90")  # a repeated activation re-checks what is imported
    getattr_, _ = lazy.lazy_attributes("ks", {"SfPaddingBlock": ("common.megamoe_constants", "SfPaddingBlock")}, {})
    with pytest.raises(TreeConflictError, match="not from the verified sm90 tree"):
        getattr_("SfPaddingBlock")


def test_lazy_resolution_from_the_verified_root_passes(fresh, tmp_path, monkeypatch):
    root = _write(tmp_path / "one" / "src")
    monkeypatch.setenv(ENV, str(root))
    tree.activate("sm90")
    ns = {}
    getattr_, _ = lazy.lazy_attributes("ks", {"SfPaddingBlock": ("common.megamoe_constants", "SfPaddingBlock"),
                                              "dumps": ("json", "dumps")}, ns)
    assert getattr_("SfPaddingBlock") == 128 and ns["SfPaddingBlock"] == 128
    assert getattr_("dumps") is json.dumps  # not a kernel module: not checked


def test_each_tree_is_hashed_once_per_process(fresh, tmp_path, monkeypatch):
    root = _write(tmp_path / "one" / "src")
    monkeypatch.setenv(ENV, str(root))
    calls = []
    real = integrity.scan_tree
    monkeypatch.setattr(integrity, "scan_tree", lambda r: calls.append(r) or real(r))
    tree.locate("sm90")
    tree.activate("sm90")
    tree.activate("sm90")
    assert calls == [str(root)]


# ------------------------------------------------------------------- importable files no manifest lists (#26)


@pytest.mark.parametrize("rel, why", [
    ("moe_hopper_fp8/planted.pyc", "byte code without its source"),  # a sourceless module, imported as is
    ("common/megamoe_constants.pyc", "byte code without its source"),  # beside a source: still never the drop's
    ("moe_hopper_fp8/heuristic_config.cpython-311-x86_64-linux-gnu.so", "a shared object"),  # shadows the .py
])
@pytest.mark.parametrize("unpinned", [False, True])
def test_byte_code_and_native_code_in_a_tree_are_refused(fresh, tmp_path, monkeypatch, rel, why, unpinned):
    root = _write(tmp_path / "extracted" / "src")
    (root / rel).write_bytes(b"\x00code nobody can read")
    monkeypatch.setenv(ENV, str(root))
    if unpinned:  # an unpinned tree opts in to edited sources, not to this
        monkeypatch.setenv("MOE_EP_UNPINNED_TREE", "sm90")
    with pytest.raises(TreeIntegrityError) as e:
        tree.activate("sm90")
    assert e.value.argument == ENV and rel in str(e.value) and why in str(e.value)
    assert "re-extract" in str(e.value) and tree.active_tree() is None
    with pytest.raises(TreeIntegrityError):
        tree.locate("sm90")


def test_a_package_directory_no_manifest_file_sits_in_is_refused(fresh, tmp_path, monkeypatch):
    root = _write(tmp_path / "extracted" / "src")
    (root / "moe_extra" / "data").mkdir(parents=True)  # importable as a namespace package
    monkeypatch.setenv(ENV, str(root))
    with pytest.raises(TreeIntegrityError, match=r"added: moe_extra/, moe_extra/data/"):
        tree.activate("sm90")


def test_byte_code_caches_of_the_sources_are_not_strays(fresh, tmp_path, monkeypatch):
    root = _write(tmp_path / "extracted" / "src")
    (root / "common" / "__pycache__").mkdir()
    (root / "common" / "__pycache__" / "megamoe_constants.cpython-311.pyc").write_bytes(b"cache")
    monkeypatch.setenv(ENV, str(root))
    assert tree.activate("sm90") == str(root)


def test_a_second_copy_of_the_kernel_packages_on_sys_path_is_refused(fresh, tmp_path, monkeypatch):
    root = _write(tmp_path / "extracted" / "src")
    other = _write(tmp_path / "site-packages", {"moe_hopper_fp8/__init__.py": "", "moe_hopper_fp8/x.py": "X = 2\n"})
    sys.path.append(str(other))
    monkeypatch.setenv(ENV, str(root))
    with pytest.raises(TreeConflictError) as e:
        tree.activate("sm90")
    assert f"{other} (provides moe_hopper_fp8)" in str(e.value) and "PYTHONPATH" in str(e.value)


def test_a_link_to_the_root_on_sys_path_is_the_same_tree(fresh, tmp_path, monkeypatch):
    root = _write(tmp_path / "extracted" / "src")
    link = tmp_path / "link"
    link.symlink_to(root)
    sys.path.append(str(link))
    monkeypatch.setenv(ENV, str(root))
    assert tree.activate("sm90") == str(root) and str(link) not in sys.path


def _flashinfer_copy(tmp_path: Path) -> Path:
    """FlashInfer's layout: the drop's packages inside its own package, importable under a long dotted name."""
    base = tmp_path / "site"
    files = {"flashinfer/__init__.py": "", "flashinfer/kernel_src/__init__.py": "",
             "flashinfer/kernel_src/src/moe_hopper_fp8/__init__.py": "",
             "flashinfer/kernel_src/src/moe_hopper_fp8/heuristic_config.py": "HEURISTIC_CONFIGS = {'copy': 1}\n"}
    _write(base, files)
    sys.path.append(str(base))
    return base


def test_a_drop_package_imported_under_another_name_before_activation_is_refused(fresh, tmp_path, monkeypatch):
    root = _write(tmp_path / "extracted" / "src")
    _flashinfer_copy(tmp_path)
    import flashinfer.kernel_src.src.moe_hopper_fp8.heuristic_config  # noqa: F401
    try:
        monkeypatch.setenv(ENV, str(root))
        with pytest.raises(TreeConflictError, match="flashinfer.kernel_src.src.moe_hopper_fp8.heuristic_config"):
            tree.activate("sm90")
    finally:
        for name in [n for n in sys.modules if n.startswith("flashinfer")]:
            del sys.modules[name]


def test_a_drop_package_imported_under_another_name_after_activation_is_refused(fresh, tmp_path, monkeypatch):
    root = _write(tmp_path / "extracted" / "src")
    monkeypatch.setenv(ENV, str(root))
    tree.activate("sm90")
    _flashinfer_copy(tmp_path)
    try:
        with pytest.raises(TreeConflictError, match="a drop package under another name"):
            import flashinfer.kernel_src.src.moe_hopper_fp8.heuristic_config  # noqa: F401
        import flashinfer.kernel_src  # noqa: F401  (the rest of the package is no kernel code)
    finally:
        for name in [n for n in sys.modules if n.startswith("flashinfer")]:
            del sys.modules[name]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
