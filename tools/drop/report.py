"""Plain-text and markdown renderings of an audit (no dependencies beyond the stdlib)."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from tools.drop.audit import EXIT_ALL_BREAK, EXIT_OK, EXIT_SOME_BREAK, AuditResult, Finding

__all__ = ["text_table", "md_table", "render_terminal", "render_markdown", "render_summary", "EXIT_MEANING"]

EXIT_MEANING = {
    EXIT_OK: "compatible",
    EXIT_SOME_BREAK: "some backends break",
    EXIT_ALL_BREAK: "all backends break",
}
_SUMMARY_ROWS = 12


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


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def _grouped_breaks(result: AuditResult) -> List[Tuple[List[str], Finding]]:
    return result.grouped_breaks()


def _backend_rows(result: AuditResult) -> List[List[str]]:
    per: Dict[str, int] = {}
    for subjects, f in _grouped_breaks(result):
        for b in {b for b, _ in f.pairs}:
            per[b] = per.get(b, 0) + 1
    broken = result.broken_pairs()
    rows = []
    for b in result.backends:
        hit = [fmt for fmt in b.formats if (b.name, fmt) in broken]
        verdict = "ok" if not hit else ("BREAK" if len(hit) == len(b.formats) else f"BREAK ({', '.join(hit)})")
        rows.append([b.name, ", ".join(b.formats), verdict, str(per.get(b.name, 0))])
    return rows


_BUILD_HEADERS = ("backend", "format", "static", "resolve", "compile", "numbers", "verdict")


def _build_rows(result: AuditResult) -> List[List[str]]:
    """One row per (backend, format) once the build stage ran: what the sources say, what resolving the knobs at
    every token bucket and compiling did, and the verdict of both."""
    report = result.build
    rows = []
    groups = [f for _, f in result.grouped_breaks() if f.section != "build"]
    for pair in result.all_pairs():
        n_break = sum(1 for f in groups if pair in f.pairs)
        n_warn = sum(1 for f in result.findings if f.section != "build" and pair in f.pairs and f.status == "warn")
        cell = f"BREAK {n_break}" if n_break else (f"warn {n_warn}" if n_warn else "ok")
        resolve, compile_, numbers = report.summary(pair) if pair in report.pairs else ("-", "-", "-")
        rows.append([pair[0], pair[1], cell, resolve, compile_, numbers,
                     "BREAK" if pair in result.broken_pairs() else "ok"])
    return rows


def _lines(sites: Sequence[str], limit: int = 3) -> str:
    shown = list(sites[:limit])
    return ", ".join(shown) + (f" +{len(sites) - limit}" if len(sites) > limit else "")


def _break_rows(result: AuditResult, width: int = 0) -> List[List[str]]:
    rows = []
    for subjects, f in _grouped_breaks(result):
        what = subjects[0] + (f" (+{len(subjects) - 1})" if len(subjects) > 1 else "")
        backends = ", ".join(sorted({b for b, _ in f.pairs})) or "(no registered backend runs it)"
        detail = _short(f.detail, width) if width else f.detail
        rows.append([f.section, _short(what, 60) if width else what, detail, _lines(f.sites), backends])
    return rows


def render_summary(result: AuditResult, markdown: bool = False) -> str:
    """The verdict: one line, a row per registered backend, a row per distinct break (capped)."""
    code = result.exit_code()
    head = f"{result.tree} {result.old_label} -> {result.new_label}: exit {code} ({EXIT_MEANING[code]}). {result.verdict()}"
    loc = result.location or {}
    tree_line = ""
    if loc:
        tree_line = f"tree at `{loc['prefix']}`" if markdown else f"tree at {loc['prefix']}"
        tree_line += f" (MOVED from {loc['expected']}; found by content)" if loc.get("moved") else f" ({loc.get('how', '')})"
    table = md_table if markdown else text_table
    out = [head]
    if tree_line:
        out.append(tree_line)
    out.append("")
    backend_rows = _backend_rows(result)
    if backend_rows and result.build is not None:
        out += [table(_BUILD_HEADERS, _build_rows(result)), ""]
        jobs = result.build.outcomes
        line = (f"build stage: {sum(o.job.stage == 'resolve' for o in jobs)} knob resolutions, "
                f"{sum(o.job.stage == 'numbers' for o in jobs)} numerical checks, "
                f"{sum(o.job.compile for o in jobs)} compiles")
        seconds, cpu = result.build.compile_seconds(), result.build.compile_seconds(cpu=True)
        if result.build.cached:
            line += " (the verdict of an identical tree, shim and plan, from the cache: nothing ran again)"
        elif not markdown and seconds:  # the report stays the same from run to run
            line += (f" in {result.build.wall_s:.0f} s on {result.build.compile_jobs} child process(es); compiles "
                     f"{min(seconds):.1f}-{max(seconds):.1f} s each (CPU {min(cpu):.1f}-{max(cpu):.1f} s)")
        out += [line, ""]
    elif backend_rows:
        out += [table(("backend", "formats", "verdict", "breaks"), backend_rows), ""]
    else:
        out += ["(no backend of this tree in the registry)", ""]
    rows = _break_rows(result, 0 if markdown else 56)
    if rows:
        shown = rows[:_SUMMARY_ROWS]
        out.append(table(("section", "what", "why", "shim lines", "breaks"), shown))
        if len(rows) > len(shown):
            out.append(f"... {len(rows) - len(shown)} more breaks: see the findings")
        out.append("")
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
    breaks = [f for f in result.findings if f.status == "break"]
    if breaks:
        # In full: the verdict below shortens each to a line; a maintainer reads the whole reason here.
        out.append("[breaks] in full: the reason (with the drop line, where known) and the shim lines")
        out.append(text_table(("section", "subject", "detail", "shim lines"),
                              [[f.section, f.subject, f.detail, ", ".join(f.sites)] for f in breaks]))
        out.append("")
    warns = [f for f in result.findings if f.status == "warn"]
    if warns:
        out.append("[warnings: review; the contract may need --accept-contract]")
        out.append(text_table(("section", "subject", "detail", "shim lines"),
                              [[f.section, f.subject, f.detail, _lines(f.sites)] for f in warns]))
        out.append("")
    out.append("=" * 100)
    out.append("[verdict] " + render_summary(result))
    return "\n".join(out) + "\n"


def render_markdown(result: AuditResult, command: str) -> str:
    out = [
        f"# Drop audit: {result.tree} {result.old_label} -> {result.new_label}",
        "",
        f"Generated by `{command}`.",
        "",
        "## Verdict",
        "",
        render_summary(result, markdown=True),
        "Exit codes: 0 compatible, 3 some backends break, 1 all backends break, 2 usage or setup error.",
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
        out.append(md_table(("status", "section", "subject", "detail", "shim lines", "backends (format)"),
                            [[f.status, f.section, f.subject, f.detail, ", ".join(f.sites),
                              ", ".join(f"{b} ({fmt})" for b, fmt in f.pairs)] for f in result.findings]))
    else:
        out.append("None.")
    return "\n".join(out) + "\n"
