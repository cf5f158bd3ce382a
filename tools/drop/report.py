"""Plain-text and markdown renderings of an audit (no dependencies beyond the stdlib)."""

from __future__ import annotations

from typing import List, Sequence

from tools.drop.audit import AuditResult

__all__ = ["text_table", "md_table", "render_terminal", "render_markdown"]


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(_md_cell(h) for h in headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _import_rows(result: AuditResult) -> List[List[str]]:
    rows = []
    for row, res in result.import_rows:
        status = {"missing_module": "BREAK: no module", "missing_symbol": "BREAK: no symbol"}.get(res.status, res.status)
        where = f"{res.module}:{res.lineno}" if res.status == "ok" and res.lineno else (res.module if res.status == "ok" else "")
        rows.append(
            [f"{row.file}:{row.lineno}", row.form, row.module, row.name or "(module)", row.export, res.kind, where, status, res.detail if res.status != "ok" else ""]
        )
    return rows


_IMPORT_HEADERS = ("shim", "form", "module", "symbol", "bound as", "kind", "defined at", "status", "detail")


def _file_rows(result: AuditResult) -> List[List[str]]:
    return [
        [d.package, d.status, str(d.old_files), str(d.new_files), str(len(d.added)), str(len(d.removed)), str(len(d.changed))]
        for d in result.package_diffs
    ]


_FILE_HEADERS = ("package", "status", "old files", "new files", "added", "removed", "changed")


def _sig_rows(result: AuditResult) -> List[List[str]]:
    rows = []
    for cls, methods in sorted(result.signatures.items()):
        for method, changes in sorted(methods.items()):
            if not changes:
                rows.append([f"{cls}.{method}", "ok", "", "matches the contract"])
            for c in changes:
                rows.append([f"{cls}.{method}", c.status, c.change, c.detail])
    for f in result.findings:
        if f.section == "signatures" and not any(f.subject.startswith(f"{cls}.") for cls in result.signatures):
            rows.append([f.subject, f.status, "", f.detail])
    return rows


_SIG_HEADERS = ("method", "status", "change", "detail")


def _knob_rows(result: AuditResult) -> List[List[str]]:
    return [[k.cls, k.knob, k.value, k.status, k.detail] for k in result.knob_rows]


_KNOB_HEADERS = ("class", "knob", "value", "status", "evidence")


def render_terminal(result: AuditResult) -> str:
    out = [f"drop audit: {result.tree}  {result.old_label} -> {result.new_label}", ""]
    out += ["[files] per kernel package", text_table(_FILE_HEADERS, _file_rows(result)), ""]
    for d in result.package_diffs:
        for label, names in (("+", d.added), ("-", d.removed), ("~", d.changed)):
            for n in names:
                out.append(f"  {label} {n}")
    if any(d.added or d.removed or d.changed for d in result.package_diffs):
        out.append("")
    out.append("[imports] the shim's import table, checked against the new drop")
    if result.import_rows:
        out += [text_table(_IMPORT_HEADERS, _import_rows(result)), ""]
    else:
        out += [f"  (no kernel imports found under shim/{result.tree} and shim/common)", ""]
    out.append("[signatures] contracted kernel classes vs tools/drop/contracts/" + result.tree + ".json")
    sig_rows = _sig_rows(result)
    out += [text_table(_SIG_HEADERS, sig_rows) if sig_rows else "  (no contracted classes)", ""]
    out.append("[knobs] the tuner's knob space vs what the new drop accepts")
    knob_rows = _knob_rows(result)
    out += [text_table(_KNOB_HEADERS, knob_rows) if knob_rows else "  (no KNOB_SPACE found)", ""]
    if result.table_only_values:
        out.append("  values the drop's heuristic tables use that the knob space does not offer:")
        for cls, knob, value in result.table_only_values:
            out.append(f"    {cls}.{knob} = {value}")
        out.append("")
    problems = [f for f in result.findings if f.status in ("break", "warn")]
    if problems:
        out.append("[findings needing action]")
        out.append(text_table(("status", "section", "subject", "detail"), [[f.status, f.section, f.subject, f.detail] for f in problems]))
        out.append("")
    out.append("verdict: " + result.verdict())
    return "\n".join(out) + "\n"


def render_markdown(result: AuditResult, command: str) -> str:
    out = [
        f"# Drop audit: {result.tree} {result.old_label} -> {result.new_label}",
        "",
        f"Generated by `{command}`. Verdict: **{result.verdict()}**",
        "",
        "## Files per kernel package",
        "",
        md_table(_FILE_HEADERS, _file_rows(result)),
        "",
    ]
    for d in result.package_diffs:
        if d.added or d.removed or d.changed:
            out.append(f"### {d.package}")
            out.append("")
            for label, names in (("added", d.added), ("removed", d.removed), ("changed", d.changed)):
                for n in names:
                    out.append(f"- {label}: `{n}`")
            out.append("")
    out += ["## Shim import table", ""]
    out.append(md_table(_IMPORT_HEADERS, _import_rows(result)) if result.import_rows else "No kernel imports under the shim.")
    out += ["", "## Kernel class signatures vs the contract", ""]
    sig_rows = _sig_rows(result)
    out.append(md_table(_SIG_HEADERS, sig_rows) if sig_rows else "No contracted classes.")
    out += ["", "## Knobs", ""]
    knob_rows = _knob_rows(result)
    out.append(md_table(_KNOB_HEADERS, knob_rows) if knob_rows else "No KNOB_SPACE found.")
    if result.table_only_values:
        out += ["", "Values the drop's heuristic tables use that the knob space does not offer:", ""]
        out += [f"- `{cls}.{knob} = {value}`" for cls, knob, value in result.table_only_values]
    out += ["", "## Findings", ""]
    if result.findings:
        out.append(md_table(("status", "section", "subject", "detail"), [[f.status, f.section, f.subject, f.detail] for f in result.findings]))
    else:
        out.append("None.")
    return "\n".join(out) + "\n"
