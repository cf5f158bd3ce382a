"""The audit reports each synthetic breakage exactly, and only it."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.tools.drop import synthetic
from tools.drop import contract as contract_mod
from tools.drop.audit import run_audit
from tools.drop.inventory import inventory_of_tree
from tools.drop.report import render_markdown, render_terminal
from tools.drop.shim_scan import lazy_tables
from tools.drop.source_model import DropIndex
from tools.drop.trees import TREES

SM90 = TREES["sm90"]


@pytest.fixture
def world(tmp_path):
    """(repo with a synthetic shim and an accepted contract, old drop root)."""
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


def new_drop(old: Path, tmp: Path) -> Path:
    return synthetic.copy_drop(old, tmp / "new")


def test_self_audit_is_clean(world):
    repo, old = world
    cutlass_before = "cutlass" in sys.modules
    result = audit(repo, old, old)
    # Source only: the synthetic kernel module imports cutlass and both it and the
    # synthetic shim raise at import time, so any import would have failed here.
    assert ("cutlass" in sys.modules) == cutlass_before
    assert findings(result) == []
    assert result.clean and result.exit_code() == 0
    assert result.verdict().startswith("CLEAN")
    # The import table is derived from the shim: eager imports + kernel _LAZY rows
    # (shim.sm90.helpers is the shim's own module, not a kernel row).
    rows = {(r.form, r.module, r.name) for r, _ in result.import_rows}
    assert rows == {
        ("from", "moe_hopper_fp8.heuristic_config", "TABLE"),
        ("from", "moe_hopper_fp8.heuristic_config", "select_heuristic_config"),
        ("from", "common.megamoe_constants", "SfPaddingBlock"),
        ("lazy", "moe_hopper_fp8.megamoe_kernel_fp8", "Sm90MegaMoEFp8Kernel"),
        ("lazy", "moe_hopper_fp8.megamoe_kernel_fp8", "Sm90MegaMoESwapABFp8Kernel"),
        ("lazy", "src.sym_buffer", "SymBufferHost"),
        ("lazy", "moe_nvfp4_swapab.topk_reduce", "topk_reduce"),
    }
    assert all(res.status == "ok" for _, res in result.import_rows)
    # Contracted classes: the _LAZY entries that are drop classes with __init__/__call__.
    assert sorted(result.signatures) == ["Sm90MegaMoEFp8Kernel", "Sm90MegaMoESwapABFp8Kernel", "SymBufferHost"]


def test_renamed_symbol(world, tmp_path):
    repo, old = world
    new = new_drop(old, tmp_path)
    synthetic.edit(new, "moe_hopper_fp8/heuristic_config.py", "def select_heuristic_config(", "def select_config(")
    result = audit(repo, old, new)
    assert findings(result) == [
        ("break", "imports", "shim/sm90/kernel_symbols.py:3 moe_hopper_fp8.heuristic_config.select_heuristic_config",
         "moe_hopper_fp8.heuristic_config defines no 'select_heuristic_config'; did you mean select_config?"),
        ("note", "files", "moe_hopper_fp8/heuristic_config.py", "file changed"),
    ]
    assert result.exit_code() == 1


def test_removed_parameter(world, tmp_path):
    repo, old = world
    new = new_drop(old, tmp_path)
    synthetic.edit(new, "moe_hopper_fp8/megamoe_kernel_fp8.py", "        dedup_dispatch: bool = False,\n", "")
    result = audit(repo, old, new)
    # The subclass inherits __init__, so both contracted classes see it.
    assert findings(result, "break", "warn") == [
        ("break", "signatures", f"{cls}.__init__(dedup_dispatch)", "removed: dedup_dispatch: bool = False removed")
        for cls in ("Sm90MegaMoEFp8Kernel", "Sm90MegaMoESwapABFp8Kernel")
    ]
    assert result.exit_code() == 1


def test_renamed_parameter(world, tmp_path):
    repo, old = world
    new = new_drop(old, tmp_path)
    synthetic.edit(new, "moe_hopper_fp8/megamoe_kernel_fp8.py", "        hidden: int,", "        hidden_size: int,")
    result = audit(repo, old, new)
    assert findings(result, "break", "warn") == [
        ("break", "signatures", f"{cls}.__init__(hidden)", "renamed: hidden -> hidden_size")
        for cls in ("Sm90MegaMoEFp8Kernel", "Sm90MegaMoESwapABFp8Kernel")
    ]
    assert result.exit_code() == 1


def test_redefaulted_parameter_warns_without_breaking(world, tmp_path):
    repo, old = world
    new = new_drop(old, tmp_path)
    synthetic.edit(new, "moe_hopper_fp8/megamoe_kernel_fp8.py", "fc1_store_offload: bool = True", "fc1_store_offload: bool = False")
    result = audit(repo, old, new)
    assert findings(result, "break", "warn") == [
        ("warn", "signatures", f"{cls}.__init__(fc1_store_offload)", "redefaulted: default True -> False")
        for cls in ("Sm90MegaMoEFp8Kernel", "Sm90MegaMoESwapABFp8Kernel")
    ]
    assert result.exit_code() == 0
    assert result.verdict().startswith("REVIEW")


def test_new_required_parameter_and_launch_reorder(world, tmp_path):
    repo, old = world
    new = new_drop(old, tmp_path)
    path = "moe_hopper_fp8/megamoe_kernel_fp8.py"
    synthetic.edit(new, path, "        hidden: int,\n", "        hidden: int,\n        num_topk: int,\n")
    synthetic.edit(new, path, "(self, activation, topk_idx, topk_weights, output, stream)", "(self, activation, topk_weights, topk_idx, output, stream)")
    result = audit(repo, old, new)
    got = findings(result, "break", "warn")
    for cls in ("Sm90MegaMoEFp8Kernel", "Sm90MegaMoESwapABFp8Kernel"):
        assert ("break", "signatures", f"{cls}.__init__(num_topk)", "added: new required parameter num_topk: int") in got
        assert ("break", "signatures", f"{cls}.__call__(topk_idx,topk_weights)", "moved: positional order changed: topk_idx, topk_weights") in got
    assert len(got) == 4


def test_added_file_is_a_note(world, tmp_path):
    repo, old = world
    new = new_drop(old, tmp_path)
    (new / "moe_hopper_fp8" / "extra_policy.py").write_text("X = 1\n")
    result = audit(repo, old, new)
    assert findings(result) == [("note", "files", "moe_hopper_fp8/extra_policy.py", "file added")]
    assert result.exit_code() == 0 and not result.clean
    assert result.verdict().startswith("OK WITH CHANGES")


def test_removed_package(world, tmp_path):
    repo, old = world
    new = new_drop(old, tmp_path)
    shutil.rmtree(new / "moe_nvfp4_swapab")
    result = audit(repo, old, new)
    assert findings(result) == [
        ("break", "imports", "shim/sm90/kernel_symbols.py:10 moe_nvfp4_swapab.topk_reduce.topk_reduce",
         "no module moe_nvfp4_swapab.topk_reduce in the drop"),
        ("note", "files", "moe_nvfp4_swapab", "package removed (2 files)"),
    ]
    assert result.exit_code() == 1


def test_added_package(world, tmp_path):
    repo, old = world
    new = new_drop(old, tmp_path)
    synthetic.write_tree(new, {"moe_hopper_bf16/__init__.py": "", "moe_hopper_bf16/k.py": "K = 1\n"})
    result = audit(repo, old, new)
    assert findings(result) == [("note", "files", "moe_hopper_bf16", "package added (2 files)")]


def test_knob_value_no_longer_accepted(world, tmp_path):
    repo, old = world
    new = new_drop(old, tmp_path)
    synthetic.edit(new, "moe_hopper_fp8/megamoe_kernel_fp8.py", 'Literal["epi_warps", "standalone_warps"]', 'Literal["epi_warps"]')
    synthetic.edit(new, "moe_hopper_fp8/base_kernel.py", '("1xacc", "2xacc")', '("1xacc",)')
    result = audit(repo, old, new)
    breaks = findings(result, "break")
    assert breaks == [
        ("break", "knobs", "Sm90MegaMoEFp8Kernel.fp8_accum_mode='2xacc'",
         "rejected by moe_hopper_fp8.base_kernel:9 (if accum_mode not in ...: raise); accepts ['1xacc']"),
        ("break", "knobs", "Sm90MegaMoEFp8Kernel.token_back_mode='standalone_warps'",
         "rejected by moe_hopper_fp8.megamoe_kernel_fp8:20 (Literal annotation); accepts ['epi_warps']"),
    ]
    assert result.exit_code() == 1


def test_knob_name_no_longer_a_parameter(world, tmp_path):
    repo, old = world
    new = new_drop(old, tmp_path)
    path = "moe_hopper_fp8/megamoe_kernel_fp8.py"
    synthetic.edit(new, path, '        load_balance_mode: str = "static",\n', "")
    synthetic.edit(new, path, "            load_balance_mode=load_balance_mode,\n", "")
    result = audit(repo, old, new)
    knob_breaks = [f for f in findings(result, "break") if f[1] == "knobs"]
    assert knob_breaks == [
        ("break", "knobs", "Sm90MegaMoEFp8Kernel.load_balance_mode",
         "not a parameter of moe_hopper_fp8.megamoe_kernel_fp8.Sm90MegaMoEFp8Kernel.__init__"),
    ]
    assert result.exit_code() == 1


def test_value_nothing_decides_is_unchecked_not_a_break(world, tmp_path):
    repo, old = world
    synthetic.edit(repo, "shim/sm90/knobs.py", '"group_hint": [None, 264]', '"group_hint": [None, 264, 132]')
    result = audit(repo, old, old)
    assert findings(result) == [
        ("unchecked", "knobs", "Sm90MegaMoEFp8Kernel.group_hint=132",
         "no Literal, membership check, constructor default or heuristic-table use decides it"),
    ]
    assert result.exit_code() == 0 and result.clean


def test_class_missing_from_contract_is_flagged(world):
    repo, old = world
    synthetic.edit(
        repo, "shim/sm90/kernel_symbols.py", '    "Helper":',
        '    "BaseGemm": ("moe_hopper_fp8.base_kernel", "BaseGemm"),\n    "Helper":',
    )
    result = audit(repo, old, old)
    assert findings(result, "break", "warn") == [
        ("warn", "signatures", "BaseGemm", "built by the shim but not in the contract: review, then bump --accept-contract"),
    ]


def test_reports_render(world, tmp_path):
    repo, old = world
    new = new_drop(old, tmp_path)
    synthetic.edit(new, "moe_hopper_fp8/heuristic_config.py", "def select_heuristic_config(", "def select_config(")
    result = audit(repo, old, new)
    text = render_terminal(result)
    md = render_markdown(result, "tools/drop audit")
    for out in (text, md):
        assert "select_heuristic_config" in out and "SHIM WOULD BREAK" in out
    assert "| shim | form | module |" in md


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
