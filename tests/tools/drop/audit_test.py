"""The audit reports each synthetic breakage exactly, with its shim lines and the backends it breaks."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.tools.drop import synthetic
from tools.drop import contract as contract_mod
from tools.drop.audit import EXIT_ALL_BREAK, EXIT_OK, EXIT_SOME_BREAK, run_audit
from tools.drop.inventory import inventory_of_tree
from tools.drop.report import render_markdown, render_summary, render_terminal
from tools.drop.shim_scan import lazy_tables
from tools.drop.source_model import DropIndex, Param
from shim.common.tree_facts import TREES

SM90 = TREES["sm90"]
FP8 = ("sm90_fp8", "fp8_block")
BF16 = ("sm90_bf16", "bf16")
KERNEL = "moe_hopper_fp8/megamoe_kernel_fp8.py"


@pytest.fixture
def world(tmp_path):
    """(repo with a synthetic shim, registry and an accepted contract, old drop root)."""
    repo = synthetic.make_shim(tmp_path / "repo")
    old = synthetic.make_drop(tmp_path / "old")
    index = DropIndex(old)
    contract = contract_mod.build_contract(index, lazy_tables(repo, "sm90"), "sm90", "1.0")
    contract_mod.save_contract(contract_mod.contract_path(repo, "sm90"), contract)
    return repo, old


def audit(repo: Path, old: Path, new: Path):
    contract = contract_mod.load_contract(contract_mod.contract_path(repo, "sm90"))
    return run_audit(repo, SM90, new, inventory_of_tree(old), inventory_of_tree(new), "1.0", "2.0", contract)


def findings(result, *statuses):
    statuses = statuses or ("break", "warn", "note", "unchecked")
    return sorted((f.status, f.section, f.subject, f.detail) for f in result.findings if f.status in statuses)


def breaks(result):
    """{subject: (shim lines, broken pairs)} of every break."""
    return {f.subject: (f.sites, f.pairs) for f in result.findings if f.status == "break"}


def new_drop(old: Path, tmp: Path) -> Path:
    return synthetic.copy_drop(old, tmp / "new")


def audit_of_edits(world, tmp: Path, *edits):
    """The audit of a copy of the old drop with each (file, text, replacement) edit made to it."""
    repo, old = world
    new = new_drop(old, tmp)
    for path, text, replacement in edits:
        synthetic.edit(new, path, text, replacement)
    return audit(repo, old, new)


def test_self_audit_is_clean(world):
    repo, old = world
    cutlass_before = "cutlass" in sys.modules
    result = audit(repo, old, old)
    # Source only: the synthetic kernel modules import cutlass and the synthetic shim raises
    # at import time, so any import would have failed here.
    assert ("cutlass" in sys.modules) == cutlass_before
    assert findings(result) == []
    assert result.clean and result.exit_code() == EXIT_OK
    assert result.verdict().startswith("CLEAN")
    assert [b.name for b in result.backends] == ["sm90_fp8", "sm90_bf16"]  # from the registry literal
    rows = {(r.form, r.module, r.name) for r, _ in result.import_rows}
    assert ("lazy", "moe_hopper_bf16.megamoe_kernel_bf16", "Sm90MegaMoEBf16Kernel") in rows
    assert ("from", "moe_hopper_fp8.heuristic_config", "TABLE") in rows
    assert not any(r.module.startswith("shim.") for r, _ in result.import_rows)
    assert sorted(result.signatures) == ["Sm90MegaMoEBf16Kernel", "Sm90MegaMoEFp8Kernel",
                                         "Sm90MegaMoESwapABFp8Kernel", "SymBufferHost"]


@pytest.fixture
def without_bf16(world, tmp_path):
    """The audit of a drop without the BF16 package (the issue's case)."""
    repo, old = world
    new = new_drop(old, tmp_path)
    shutil.rmtree(new / "moe_hopper_bf16")
    return audit(repo, old, new)


def test_missing_bf16_package_breaks_only_the_bf16_backend(without_bf16):
    # A drop without the BF16 package must not read like one where everything breaks.
    result = without_bf16
    got = breaks(result)
    assert got["moe_hopper_bf16.megamoe_kernel_bf16.Sm90MegaMoEBf16Kernel"] == (
        ("shim/sm90/kernel_symbols.py:9", "shim/sm90/bf16_frontend.py:10"), (BF16,))
    # The format-guarded heuristic line in knobs.py: only the bf16 branch uses it.
    assert got["moe_hopper_bf16.heuristic_config.select_heuristic_config (shim name select_bf16_config)"] == (
        ("shim/sm90/kernel_symbols.py:10", "shim/sm90/knobs.py:22"), (BF16,))
    assert got["Sm90MegaMoEBf16Kernel"][1] == (BF16,)  # class gone (signatures) and knob space (knobs)
    assert all(pairs == (BF16,) for _, pairs in got.values())
    assert result.exit_code() == EXIT_SOME_BREAK
    assert result.verdict().startswith("SOME BACKENDS BREAK (1 of 2: sm90_bf16)")


def test_removed_parameter_the_shim_passes_maps_to_its_call_sites(world, tmp_path):
    result = audit_of_edits(world, tmp_path, (
        KERNEL, '        token_back_mode: Literal["epi_warps", "standalone_warps"] = "epi_warps",\n', ""))
    got = breaks(result)
    # Constructor keyword in the shared sm90 frontend, the knob key in knobs.py; only the FP8
    # kernel lost it, so only the FP8 backend breaks although the BF16 one runs the same line.
    for cls in ("Sm90MegaMoEFp8Kernel", "Sm90MegaMoESwapABFp8Kernel"):
        assert got[f"{cls}.__init__(token_back_mode)"] == (("shim/sm90/frontend.py:23", "shim/sm90/knobs.py:9"), (FP8,))
    assert got["Sm90MegaMoEFp8Kernel.token_back_mode"] == (("shim/sm90/knobs.py:9",), (FP8,))
    assert result.exit_code() == EXIT_SOME_BREAK


def test_removed_launch_argument_breaks_every_backend(world, tmp_path):
    result = audit_of_edits(
        world, tmp_path,
        (KERNEL, "activation_sf, topk_idx, topk_weights, output", "activation_sf, topk_idx, output"),
        ("moe_hopper_bf16/megamoe_kernel_bf16.py", "topk_idx, topk_weights, output", "topk_idx, output"))
    got = breaks(result)
    # The launch arguments are collected in the tree-agnostic shim/common/.
    assert got["Sm90MegaMoEFp8Kernel.__call__(topk_weights)"] == (("shim/common/frontend.py:8",), (FP8,))
    assert got["Sm90MegaMoEBf16Kernel.__call__(topk_weights)"] == (("shim/common/frontend.py:8",), (BF16,))
    assert result.exit_code() == EXIT_ALL_BREAK
    assert result.verdict().startswith("ALL BACKENDS BREAK (2 of 2)")


def test_removed_parameter_nobody_passes_is_a_warning(world, tmp_path):
    repo, _ = world
    # A shim that leaves dedup_dispatch to the drop (its own audit warns of that), then a drop without it.
    synthetic.edit(repo, "shim/sm90/fp8_frontend.py", " dedup_dispatch=False,", "")
    result = audit_of_edits(world, tmp_path, (KERNEL, "        dedup_dispatch: bool = False,\n", ""))
    assert findings(result, "break", "warn") == [
        ("warn", "signatures", f"{cls}.__init__(dedup_dispatch)",
         "removed: dedup_dispatch: bool = False removed; no shim line passes it: accept the contract once reviewed")
        for cls in ("Sm90MegaMoEFp8Kernel", "Sm90MegaMoESwapABFp8Kernel")
    ]
    assert result.exit_code() == EXIT_OK


# ---- a parameter the shim does not pass is a decision: behaviour, not only signatures ---------------------------

NEW_DEFAULTED = (KERNEL, "        fc1_store_offload: bool = True,\n",
                 "        fc1_store_offload: bool = True,\n        swiglu_limit: Optional[float] = 7.0,\n")


def test_a_new_parameter_with_a_default_nobody_passes_breaks_until_the_shim_pins_it(world, tmp_path):
    result = audit_of_edits(world, tmp_path, NEW_DEFAULTED)
    got = [f for f in result.findings if f.status == "break"]
    assert [f.subject for f in got] == [f"{c}.__init__(swiglu_limit)" for c in ("Sm90MegaMoEFp8Kernel",
                                                                                "Sm90MegaMoESwapABFp8Kernel")]
    for f in got:
        assert f.detail == ("added: new optional parameter swiglu_limit: Optional[float] = 7.0; changes behaviour "
                            "unless the shim pins it: no shim line passes swiglu_limit for sm90_fp8 (pass the value "
                            "the shim wants, then accept the contract)")
        # Where the FP8 layer's constructor arguments are collected: the arch's and the format's.
        assert f.sites == ("shim/sm90/fp8_frontend.py:13", "shim/sm90/frontend.py:17") and f.pairs == (FP8,)
    assert result.exit_code() == EXIT_SOME_BREAK


def test_a_new_parameter_the_shim_pins_is_a_note(world, tmp_path):
    repo, _ = world
    synthetic.edit(repo, "shim/sm90/fp8_frontend.py", "fc1_store_offload=True)",
                   "fc1_store_offload=True, swiglu_limit=None)")
    result = audit_of_edits(world, tmp_path, NEW_DEFAULTED)
    assert [(f.status, f.detail) for f in result.findings if f.subject.endswith("(swiglu_limit)")] == [
        ("note", "added: new optional parameter swiglu_limit: Optional[float] = 7.0; the shim pins it: accept the "
                 "contract")] * 2
    assert result.exit_code() == EXIT_OK


def test_a_changed_default_breaks_where_the_shim_relies_on_it_and_not_where_it_pins_it(world, tmp_path):
    repo, _ = world
    synthetic.edit(repo, "shim/sm90/fp8_frontend.py", " dedup_dispatch=False,", "")
    result = audit_of_edits(world, tmp_path, (KERNEL, "dedup_dispatch: bool = False", "dedup_dispatch: bool = True"),
                            (KERNEL, "fc1_store_offload: bool = True", "fc1_store_offload: bool = False"))
    by = {f.subject: f for f in result.findings if f.subject.startswith("Sm90MegaMoEFp8Kernel.__init__")}
    relied, pinned = by["Sm90MegaMoEFp8Kernel.__init__(dedup_dispatch)"], by["Sm90MegaMoEFp8Kernel.__init__(fc1_store_offload)"]
    assert relied.status == "break" and relied.pairs == (FP8,)
    assert relied.detail.startswith("redefaulted: default False -> True; changes behaviour unless the shim pins it")
    assert pinned.status == "note" and pinned.detail == "redefaulted: default True -> False; the shim pins it: accept the contract"


def test_a_default_the_shim_relies_on_is_a_warning_in_its_own_audit(world):
    repo, old = world
    synthetic.edit(repo, "shim/sm90/fp8_frontend.py", " dedup_dispatch=False,", "")
    result = audit(repo, old, old)
    assert findings(result, "break", "warn") == [
        ("warn", "signatures", f"{c}.__init__(dedup_dispatch)",
         "the shim relies on the drop's default dedup_dispatch = False for sm90_fp8: pass it explicitly, so that a "
         "drop that changes it is a break the audit names") for c in ("Sm90MegaMoEFp8Kernel", "Sm90MegaMoESwapABFp8Kernel")]


def test_a_new_default_of_a_class_the_shim_never_calls_is_a_note(world, tmp_path):
    repo, old = world
    # The shim names the base class (as sm100's names an epilogue class for its constants) but never calls it.
    synthetic.edit(repo, "shim/sm90/kernel_symbols.py", '    "Helper":', '    "BaseGemm": ("moe_hopper_fp8.base_kernel", '
                   '"BaseGemm"),\n    "Helper":')
    index = DropIndex(old)
    contract_mod.save_contract(contract_mod.contract_path(repo, "sm90"),
                               contract_mod.build_contract(index, lazy_tables(repo, "sm90"), "sm90", "1.0"))
    result = audit_of_edits(world, tmp_path, ("moe_hopper_fp8/base_kernel.py", 'accum_mode="1xacc"):',
                                              'accum_mode="1xacc", swiglu_limit=7.0):'))
    assert [(f.status, f.detail) for f in result.findings if f.subject == "BaseGemm.__init__(swiglu_limit)"] == [
        ("note", "added: new optional parameter swiglu_limit = 7.0; the shim never calls it")]
    assert result.exit_code() == EXIT_OK


def test_a_constructor_that_hands_kwargs_on_takes_what_its_base_takes(world, tmp_path):
    # The swap-AB class grows a constructor of its own that forwards to the FP8 one (as 0.7.4's W4A8 kernel does):
    # its own new parameter is a decision, the base's parameters stay visible, a setdefault is a new default.
    forwarding = ("class Sm90MegaMoESwapABFp8Kernel(Sm90MegaMoEFp8Kernel):\n    pass\n",
                  "class Sm90MegaMoESwapABFp8Kernel(Sm90MegaMoEFp8Kernel):\n"
                  "    def __init__(self, *args, tail_n8=False, **kwargs):\n"
                  "        kwargs.setdefault(\"dedup_dispatch\", True)\n"
                  "        super().__init__(*args, **kwargs)\n")
    result = audit_of_edits(world, tmp_path, (KERNEL,) + forwarding)
    swap = {f.subject: f for f in result.findings if f.subject.startswith("Sm90MegaMoESwapABFp8Kernel.__init__")}
    assert set(swap) == {"Sm90MegaMoESwapABFp8Kernel.__init__(tail_n8)",
                         "Sm90MegaMoESwapABFp8Kernel.__init__(dedup_dispatch)"}
    assert swap["Sm90MegaMoESwapABFp8Kernel.__init__(tail_n8)"].status == "break"
    assert swap["Sm90MegaMoESwapABFp8Kernel.__init__(dedup_dispatch)"].status == "note"  # the shim passes False
    assert swap["Sm90MegaMoESwapABFp8Kernel.__init__(dedup_dispatch)"].detail.startswith(
        "redefaulted: default False -> True")


def test_rename_needs_evidence(world, tmp_path):
    # Same slot, same type: a rename the shim still uses the old name of.
    result = audit_of_edits(world, tmp_path, (KERNEL, "        hidden: int,", "        hidden_size: int,"))
    assert breaks(result)["Sm90MegaMoEFp8Kernel.__init__(hidden)"][0] == ("shim/sm90/frontend.py:22",)
    assert "renamed: hidden -> hidden_size" in [
        f.detail for f in result.findings if f.subject == "Sm90MegaMoEFp8Kernel.__init__(hidden)"]


def test_removed_and_unrelated_added_are_not_a_rename():
    # The dedup_dispatch case: one parameter gone, an unrelated one of the same type added
    # elsewhere; a pairing by type alone called it a rename.
    def p(name, default="False", kind="keyword_only", annotation="bool"):
        return Param(name, kind, annotation, default)

    old = (p("world_size", None, annotation="int"), p("dedup_dispatch"), p("fc1_store_offload", "True"), p("generate_c"))
    new = (p("world_size", None, annotation="int"), p("fc1_store_offload", "True"), p("token_back_by_dispatch"), p("generate_c"))
    changes = {(c.change, c.param) for c in contract_mod.diff_params(old, new)}
    assert changes == {("removed", "dedup_dispatch"), ("added", "token_back_by_dispatch")}
    # Same slot and type: a rename. Same slot, conflicting types: not one.
    renamed = (p("world_size", None, annotation="int"), p("dedup_tokens"), p("fc1_store_offload", "True"), p("generate_c"))
    assert [(c.change, c.detail) for c in contract_mod.diff_params(old, renamed)] == [
        ("renamed", "dedup_dispatch -> dedup_tokens")]
    retyped = (p("world_size", None, annotation="int"), p("dedup_tokens", "0", annotation="int"),
               p("fc1_store_offload", "True"), p("generate_c"))
    assert {c.change for c in contract_mod.diff_params(old, retyped)} == {"removed", "added"}


def test_removed_kernel_class(world, tmp_path):
    result = audit_of_edits(world, tmp_path,
                            (KERNEL, "class Sm90MegaMoESwapABFp8Kernel(Sm90MegaMoEFp8Kernel):\n    pass\n", ""))
    got = breaks(result)
    assert got["Sm90MegaMoESwapABFp8Kernel"] == (("shim/sm90/fp8_frontend.py:10",), (FP8,))
    assert got["moe_hopper_fp8.megamoe_kernel_fp8.Sm90MegaMoESwapABFp8Kernel (shim name SwapAB)"] == (
        ("shim/sm90/kernel_symbols.py:8", "shim/sm90/fp8_frontend.py:10"), (FP8,))
    assert result.exit_code() == EXIT_SOME_BREAK


def test_renamed_package(world, tmp_path):
    repo, old = world
    new = new_drop(old, tmp_path)
    (new / "moe_nvfp4_swapab").rename(new / "moe_nvfp4_swapab_v2")
    result = audit(repo, old, new)
    assert findings(result, "note") == [("note", "files", "moe_nvfp4_swapab -> moe_nvfp4_swapab_v2",
                                         "package renamed (2 of 2 files identical)")]
    (f,) = [f for f in result.findings if f.status == "break"]
    assert f.detail.endswith("the package was renamed: moe_nvfp4_swapab_v2.topk_reduce")
    # topk_reduce is called from shim/common/: every backend runs that line.
    assert f.sites == ("shim/sm90/kernel_symbols.py:12", "shim/common/frontend.py:11") and f.pairs == (BF16, FP8)
    assert result.exit_code() == EXIT_ALL_BREAK


def test_new_package_is_a_note(world, tmp_path):
    repo, old = world
    new = new_drop(old, tmp_path)
    synthetic.write_tree(new, {"moe_hopper_mxfp4/__init__.py": "", "moe_hopper_mxfp4/k.py": "K = 1\n"})
    result = audit(repo, old, new)
    assert findings(result) == [("note", "files", "moe_hopper_mxfp4", "package added (2 files)")]
    assert result.exit_code() == EXIT_OK


def test_stray_compiled_files_are_reported(world, tmp_path):
    repo, old = world
    new = new_drop(old, tmp_path)
    synthetic.write_tree(new, {"common/__pycache__/megamoe_constants.cpython-311.pyc": "x",
                               "src/sym_buffer.pyc": "y"})
    result = audit(repo, old, new)
    assert findings(result) == [
        ("warn", "files", "common/__pycache__/megamoe_constants.cpython-311.pyc",
         "compiled file in the tree, not part of the drop (delete it; the drop is consumed verbatim)"),
        ("warn", "files", "src/sym_buffer.pyc",
         "compiled file in the tree, not part of the drop (delete it; the drop is consumed verbatim)"),
    ]
    assert not result.clean


def test_a_new_required_parameter_of_a_drop_function_breaks_its_callers(world, tmp_path):
    # The select_heuristic_config case: no class signature changes, every FP8 layer fails with a TypeError.
    result = audit_of_edits(world, tmp_path, ("moe_hopper_fp8/heuristic_config.py",
                                              "def select_heuristic_config(tokens)", "def select_heuristic_config(tokens, ranks)"))
    assert [(f.section, f.subject, f.detail, f.sites, f.pairs) for f in result.findings if f.status == "break"] == [
        ("calls", "moe_hopper_fp8.heuristic_config.select_heuristic_config()",
         "requires ranks, which the shim does not pass (moe_hopper_fp8.heuristic_config:25)",
         ("shim/sm90/knobs.py:23",), (FP8,))]
    assert result.exit_code() == EXIT_SOME_BREAK


def test_a_renamed_field_the_shim_reads_breaks_only_where_it_is_read(world, tmp_path):
    result = audit_of_edits(world, tmp_path, ("moe_hopper_fp8/heuristic_config.py",
                                              "    cluster_shape_mnk: Tuple[int, int, int]\n",
                                              "    cluster_shape: Tuple[int, int, int]\n"),
                            ("moe_hopper_fp8/heuristic_config.py", "tile, cluster_shape_mnk=cga", "tile, cluster_shape=cga"))
    got = [(f.section, f.subject, f.detail, f.sites, f.pairs) for f in result.findings
           if f.status == "break" and f.section == "reads"]
    assert got == [("reads", "moe_hopper_fp8.heuristic_config.TileConfig.cluster_shape_mnk",
                    "the shim reads .cluster_shape_mnk of a TileConfig, which has no such attribute in this drop "
                    "(moe_hopper_fp8.heuristic_config:9); did you mean cluster_shape?",
                    ("shim/sm90/knobs.py:24",), (FP8,))]


def test_knob_value_no_longer_accepted(world, tmp_path):
    result = audit_of_edits(world, tmp_path, ("moe_hopper_fp8/base_kernel.py", '("1xacc", "2xacc")', '("1xacc",)'))
    assert [(f.subject, f.detail, f.sites, f.pairs) for f in result.findings if f.status == "break"] == [
        ("Sm90MegaMoEFp8Kernel.fp8_accum_mode='2xacc'",
         "rejected by moe_hopper_fp8.base_kernel:9 (if accum_mode not in ...: raise); accepts ['1xacc']",
         ("shim/sm90/knobs.py:8",), (FP8,)),
    ]


def test_value_nothing_decides_is_unchecked_not_a_break(world):
    repo, old = world
    synthetic.edit(repo, "shim/sm90/knobs.py", '"group_hint": [None, 264]', '"group_hint": [None, 264, 132]')
    result = audit(repo, old, old)
    assert findings(result) == [
        ("unchecked", "knobs", "Sm90MegaMoEFp8Kernel.group_hint=132",
         "no Literal, membership check, constructor default or heuristic-table use decides it"),
    ]
    assert result.exit_code() == EXIT_OK and result.clean


def test_shim_passing_a_name_the_kernel_lacks_is_flagged(world):
    repo, old = world
    synthetic.edit(repo, "shim/sm90/fp8_frontend.py", "fc1_store_offload=True)", "fc1_store_offload=True, fp8_scale=1)")
    result = audit(repo, old, old)
    assert ("warn", "calls", "Sm90MegaMoEFp8Kernel.__init__(fp8_scale)",
            "the shim passes fp8_scale, which moe_hopper_fp8.megamoe_kernel_fp8.Sm90MegaMoEFp8Kernel.__init__ "
            "does not take") in findings(result)


def test_verdict_fits_one_screen(without_bf16):
    result = without_bf16
    summary = render_summary(result)
    lines = summary.splitlines()
    assert len(lines) <= 25 and max(map(len, lines)) <= 240
    assert lines[0].startswith("sm90 1.0 -> 2.0: exit 3 (some backends break)")
    assert any(line.split()[:3] == ["sm90_bf16", "bf16", "BREAK"] for line in lines)
    assert any(line.split()[:3] == ["sm90_fp8", "fp8_block", "ok"] for line in lines)
    text, md = render_terminal(result), render_markdown(result, "tools/drop audit")
    assert text.rstrip().endswith(summary.rstrip())  # the verdict is what stays on screen
    assert md.index("## Verdict") < md.index("## Files per kernel package")
    assert "| sm90_bf16 | bf16 | BREAK | 4 |" in md


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
