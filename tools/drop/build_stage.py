"""The audit's build stage: the shim resolves knobs and compiles kernels against the candidate tree, on the CPU.

The static sections of the audit say what the sources suggest; this stage says what happens. For every registered
backend of the tree and each of its formats, child processes (tools/drop/build_child.py; one tree per process: the
trees share top-level package names) load the candidate tree and the checkout's shim and:

  1. resolve knobs as a layer would (shim.common.backend.compile_only_frontend: the backend's rules, the drop's
     heuristic, the kernel object built) at every capacity across the drop's token buckets, RESOLVE_CAPACITIES
     (1, 8, 9, 16, 17, ..., 32768, 32769): milliseconds each, no compile;
  2. resolve every shipped knob-table row of the arch (shim/<arch>/tables/*.json): its knobs at its capacity and
     world size, on the small GEOMETRY below (a row's own model geometry would allocate gigabytes of host buffers
     for what the knobs decide); a row measured on the audited drop is used at run time, one measured on another
     drop is not (it reads as stale);
  3. compile (cute.compile with CUTE_DSL_ARCH from the tree facts; 3-14 s each on an idle 2-core machine, up to
     ~35 s on a loaded one) the heuristic's knobs at COMPILE_CAPACITIES (a small, a middle and a large bucket)
     and, when asked (`--compile-tables`: a dozen more on sm90), each distinct table row in use.

Verdict per (backend, format): a failure in 1 or 3, or in 2 for a row in use, is a BREAK naming the exception, the
capacities, the shim line it was raised under and the drop line; a stale row that fails is a warning. A static break
(imports, signatures, calls, reads) whose backends all resolve and compile here is downgraded to a warning that keeps
its reason; static knob-space breaks stay breaks (the tuner may pick values the heuristic never does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from shim.common.tree_facts import DROP_PACKAGES, TREES, TreeFacts
from tools.drop import numerics
from tools.drop.build_child import MARK

__all__ = ["RESOLVE_CAPACITIES", "COMPILE_CAPACITIES", "GEOMETRY", "Job", "Outcome", "BuildReport", "plan_jobs",
           "run_build", "apply_build"]

RESOLVE_CAPACITIES: Tuple[int, ...] = (1,) + tuple(c for k in range(3, 16) for c in (1 << k, (1 << k) + 1))
COMPILE_CAPACITIES: Tuple[int, ...] = (8, 256, 4096)
# Small, valid for every backend of both trees (the compile tests' geometry); extents are symbolic in the program.
GEOMETRY = {"hidden_size": 512, "intermediate_size": 256, "num_experts": 4, "top_k": 2}
# Static sections whose breaks a successful build contradicts (knob-space findings are about values the build
# did not try).
BUILD_CHECKED_SECTIONS = ("imports", "signatures", "calls", "reads")

Pair = Tuple[str, str]


@dataclasses.dataclass(frozen=True)
class Job:
    id: int
    backend: str
    fmt: str
    capacity: int
    compile: bool
    knobs: Optional[dict] = None  # explicit (a table row); None: the shim's resolution (the heuristic)
    world_size: int = 1
    source: str = "heuristic"  # or "table <key>"
    in_use: bool = True  # False: a table row measured on another drop (never used with this one)
    numbers: bool = False  # the numerical check (tools/drop/numerics.py) instead of a resolve or a compile

    @property
    def stage(self) -> str:
        return "numbers" if self.numbers else "compile" if self.compile else "resolve"

    def as_plan(self) -> dict:
        return {"id": self.id, "backend": self.backend, "fmt": self.fmt, "capacity": self.capacity,
                "compile": self.compile, "numbers": self.numbers, "knobs": self.knobs,
                "geometry": dict(numerics.GEOMETRY if self.numbers else GEOMETRY), "world_size": self.world_size}


@dataclasses.dataclass(frozen=True)
class Outcome:
    job: Job
    ok: bool
    stage: str  # resolve | compile | numbers
    seconds: float
    cpu_seconds: float = 0.0
    knobs: Optional[dict] = None
    error: str = ""
    shim_site: Optional[str] = None
    drop_site: Optional[str] = None
    kernel: Optional[str] = None  # the kernel class the job built

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["job"] = dataclasses.asdict(self.job)
        return out

    @staticmethod
    def from_json(data: dict) -> "Outcome":
        job = dict(data["job"])
        for name in ("knobs",):
            job[name] = job.get(name)
        return Outcome(**{**data, "job": Job(**job)})


@dataclasses.dataclass
class BuildReport:
    arch: str
    pairs: List[Pair]
    outcomes: List[Outcome]
    wall_s: float
    compile_jobs: int
    cached: Optional[str] = None  # the cache file the verdict was read from, when it was not built again

    def of(self, pair: Pair) -> List[Outcome]:
        return [o for o in self.outcomes if (o.job.backend, o.job.fmt) == pair]

    def builds(self, pair: Pair) -> bool:
        """Every job of the pair that counts (not stale table rows) succeeded, and at least one compiled."""
        mine = [o for o in self.of(pair) if o.job.in_use]
        return bool(mine) and all(o.ok for o in mine) and any(o.job.compile for o in mine)

    def compile_seconds(self, cpu: bool = False) -> List[float]:
        return [o.cpu_seconds if cpu else o.seconds for o in self.outcomes if o.job.compile and o.ok]

    def summary(self, pair: Pair) -> Tuple[str, str, str]:
        """(resolve, compile, numbers) cells of the verdict table."""
        mine = [o for o in self.of(pair) if o.job.in_use]
        res = [o for o in mine if o.job.stage == "resolve"]
        com = [o for o in mine if o.job.stage == "compile"]
        num = [o for o in mine if o.job.stage == "numbers"]
        bad_res = [o.job.capacity for o in res if not o.ok]
        resolve = (f"ok ({len(res)})" if res and not bad_res else
                   f"FAIL at {_ranges(bad_res)}" if bad_res else "-")
        numbers = "-" if not num else "FAIL" if any(not o.ok for o in num) else "ok"
        if not com:
            return resolve, "-", numbers
        bad = [o for o in com if not o.ok]
        if bad:
            return resolve, f"FAIL ({len(bad)} of {len(com)})", numbers
        return resolve, f"ok ({len(com)}, {max(o.seconds for o in com):.0f} s max)", numbers


def _ranges(values: Sequence[int]) -> str:
    """Failing capacities as ranges of what a layer asks for: bucket b covers (previous bucket, b]."""
    caps = sorted(set(values))
    grid = sorted(set(RESOLVE_CAPACITIES) | set(caps))
    out: List[str] = []
    i = 0
    while i < len(caps):
        j = i
        while j + 1 < len(caps) and grid.index(caps[j + 1]) == grid.index(caps[j]) + 1:
            j += 1
        out.append(str(caps[i]) if i == j else f"{caps[i]}-{caps[j]}")
        i = j + 1
    return ", ".join(out)


# ---- the plan ----------------------------------------------------------------------------------


def _table_rows(repo: Path, arch: str) -> List[Tuple[str, dict, dict]]:
    """(key, knobs, meta) of every shipped knob-table row of `arch`."""
    folder = Path(repo) / "shim" / arch / "tables"
    rows = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        for key, entry in sorted(json.loads(path.read_text()).get("entries", {}).items()):
            rows.append((key, dict(entry.get("knobs", {})), dict(entry.get("meta", {}))))
    return rows


def _row_key(key: str) -> Optional[Tuple[str, int, int]]:
    """(fmt, world size, capacity) from a table key arch/fmt/H../I../E../K../W../C../..."""
    parts = key.split("/")
    try:
        fields = {p[0]: int(p[1:]) for p in parts[2:8]}
        return parts[1], fields["W"], fields["C"]
    except (KeyError, ValueError, IndexError):
        return None


def plan_jobs(repo: Path, arch: str, pairs: Sequence[Pair], *, compile_capacities: Sequence[int] = COMPILE_CAPACITIES,
              drop_sha256: Optional[str] = None, compile: bool = True, compile_tables: bool = False,
              resolve_capacities: Sequence[int] = RESOLVE_CAPACITIES, tables: bool = True,
              numbers: bool = True) -> List[Job]:
    """The jobs of one tree: resolves for every pair at `resolve_capacities` and for every table row, the numerical
    check of every pair that has one (unless not `numbers`), compiles of the heuristic at `compile_capacities`
    (unless not `compile`) and, with `compile_tables`, of each distinct table row in use."""
    jobs: List[Job] = []

    def add(**kw) -> None:
        jobs.append(Job(id=len(jobs), **kw))

    for backend, fmt in pairs:
        for c in resolve_capacities:
            add(backend=backend, fmt=fmt, capacity=c, compile=False)
        if numbers and (arch, fmt) in numerics.CHECKS:
            add(backend=backend, fmt=fmt, capacity=numerics.TOKENS, compile=False, numbers=True,
                source="numerical check")
    compiled_rows = set()
    for key, knobs, meta in _table_rows(repo, arch) if tables else ():
        parsed = _row_key(key)
        if parsed is None:
            continue
        fmt, world, capacity = parsed
        sha = str(meta.get("drop_sha256") or key.rpartition("/drop=")[2])
        in_use = bool(drop_sha256 and sha and drop_sha256.lower().startswith(sha.lower()[:16]))
        program = (fmt, json.dumps(knobs, sort_keys=True))
        for backend, f in pairs:
            if f != fmt:
                continue
            build = compile and compile_tables and in_use and program not in compiled_rows
            if build:
                compiled_rows.add(program)
            add(backend=backend, fmt=fmt, capacity=capacity, compile=build, knobs=knobs, world_size=world,
                source=f"table {key}", in_use=in_use)
    if compile:
        for backend, fmt in pairs:
            for c in compile_capacities:
                add(backend=backend, fmt=fmt, capacity=c, compile=True)
    return jobs


# ---- running it --------------------------------------------------------------------------------


# What tells a process it runs from Bazel's runfiles: the shim's tree guard takes a tree found through them as the
# pinned one (shim/common/tree.py), so a child that inherited them would see a second tree beside the candidate.
_RUNFILES_ENV = ("RUNFILES_DIR", "RUNFILES_MANIFEST_FILE", "RUNFILES_MANIFEST_ONLY", "PYTHON_RUNFILES", "TEST_SRCDIR",
                 "JAVA_RUNFILES")


def _holds_a_tree(entry: str) -> bool:
    """A path entry that would put kernel packages on sys.path: a tree's Bazel repository (the binary's runfiles
    carry both) or any directory holding a drop package."""
    base = os.path.basename(os.path.normpath(entry))
    if base in {t.repo_name for t in TREES.values()}:
        return True
    return any(os.path.isdir(os.path.join(entry, name)) for name in DROP_PACKAGES)


def child_env(repo: Path, tree: TreeFacts, tree_root: Path, environ: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The build child's environment: exactly one kernel tree, the candidate, named by the tree's variable, whatever
    the launcher's. `bazel run //tools:drop` puts both pinned trees on PYTHONPATH (the binary carries them as data)
    and names its runfiles; inherited, either makes the shim's guard refuse every job (TreeConflictError) or take
    the pinned tree for the candidate. So PYTHONPATH is the checkout first, then the launcher's entries that hold no
    kernel package, and no runfiles variable is passed on."""
    env = dict(os.environ if environ is None else environ)
    for name in _RUNFILES_ENV:
        env.pop(name, None)
    for other in TREES.values():
        env.pop(other.env_var, None)
    kept = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e and not _holds_a_tree(e)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(repo)] + kept))
    env[tree.env_var] = str(tree_root)
    env["MOE_EP_UNPINNED_TREE"] = tree.arch  # a candidate drop matches no pin yet; the child says so on stderr
    env["CUTE_DSL_ARCH"] = tree.cute_arch
    env["MOE_EP_NO_KNOB_TABLES"] = "1"
    return env


def _split(jobs: List[Job], n: int) -> List[List[Job]]:
    """Resolves (milliseconds) and numerical checks (seconds) in the first child; compiles dealt out so each child
    gets the same number."""
    out: List[List[Job]] = [[] for _ in range(max(1, n))]
    out[0] += [j for j in jobs if not j.compile]
    for i, job in enumerate(j for j in jobs if j.compile):
        out[i % len(out)].append(job)
    return [chunk for chunk in out if chunk]


def run_build(repo: Path, tree: TreeFacts, tree_root: Path, jobs: List[Job], *, compile_jobs: int = 1,
              log: Callable[[str], None] = print, timeout_per_compile: float = 300.0) -> BuildReport:
    """Runs the jobs in `compile_jobs` child processes against the tree at `tree_root` (the checkout `repo`'s
    shim); a child that dies or overruns fails the jobs it had not reported, with the end of its stderr."""
    t0 = time.perf_counter()
    results: Dict[int, Outcome] = {}
    chunks = _split(jobs, compile_jobs)
    compiles = sum(1 for j in jobs if j.compile)
    checks = sum(1 for j in jobs if j.numbers)
    log(f"{tree.arch}: build stage: {len(jobs) - compiles - checks} knob resolutions, {checks} numerical checks and "
        f"{compiles} compiles in {len(chunks)} child process(es) against {tree_root}")
    with tempfile.TemporaryDirectory(prefix="drop-build-") as tmp:
        children = []
        for n, chunk in enumerate(chunks):
            plan = Path(tmp) / f"plan{n}.json"
            plan.write_text(json.dumps({"tree_root": str(tree_root), "jobs": [j.as_plan() for j in chunk]}))
            out, err = Path(tmp) / f"out{n}.txt", Path(tmp) / f"err{n}.txt"
            with open(out, "w") as o, open(err, "w") as e:
                proc = subprocess.Popen([sys.executable, "-m", "tools.drop.build_child", str(plan)], cwd=str(repo),
                                        env=child_env(repo, tree, tree_root), stdout=o, stderr=e, start_new_session=True)
            budget = 60 + timeout_per_compile * max(1, sum(j.compile for j in chunk))
            children.append({"proc": proc, "jobs": {j.id: j for j in chunk}, "out": out, "err": err, "seen": 0,
                             "deadline": time.monotonic() + budget, "killed": False})
        while children:
            time.sleep(0.2)
            for child in list(children):
                _collect(child, results, log)
                proc = child["proc"]
                if proc.poll() is None and time.monotonic() > child["deadline"]:
                    os.killpg(proc.pid, signal.SIGKILL)
                    child["killed"] = True
                    proc.wait()
                if proc.poll() is not None:
                    _collect(child, results, log)
                    tail = child["err"].read_text(errors="replace")[-1500:].strip()
                    why = "ran out of time" if child["killed"] else f"exited with {proc.returncode}"
                    for job in child["jobs"].values():
                        if job.id not in results:
                            results[job.id] = Outcome(job, False, job.stage, 0.0,
                                                      error=f"the build child {why} before this job reported: {tail}")
                    children.remove(child)
    pairs = list(dict.fromkeys((j.backend, j.fmt) for j in jobs))
    return BuildReport(tree.arch, pairs, [results[j.id] for j in jobs], time.perf_counter() - t0, len(chunks))


def _collect(child: dict, results: Dict[int, Outcome], log: Callable[[str], None]) -> None:
    """The child's complete result lines written since the last look."""
    text = child["out"].read_text(errors="replace")
    lines = text[child["seen"]:].split("\n")
    done = lines[:-1]  # the last piece may be a line still being written
    child["seen"] += sum(len(line) + 1 for line in done)
    for line in done:
        if not line.startswith(MARK):
            continue
        data = json.loads(line[len(MARK):])
        job = child["jobs"][data.pop("id")]
        results[job.id] = Outcome(job, **data)
        if job.compile:
            state = "ok" if data["ok"] else "FAILED: " + data["error"][:200]
            log(f"  compile {job.backend} [{job.fmt}] capacity {job.capacity} ({job.source}): {state} "
                f"({data['seconds']:.1f} s, CPU {data['cpu_seconds']:.1f} s)")


# ---- every kernel class a backend can select ----------------------------------------------------------


def cover_jobs(report: BuildReport, classes: Dict[Pair, Sequence[str]], start: int) -> List[Job]:
    """One compile for each kernel class a pair can select (its format row's kernel_classes) that no compile of the
    report built: with the knob set of a resolve that built that class, the pair's own first, else one of another
    pair whose knobs draw from the same knob space (the same knob-set `kernel`), e.g. a shipped table row. The
    heuristic alone never builds Hopper's non-swap BF16 or per-tensor FP8 kernel, which the tuner and a knob cache
    can select."""
    compiled = {(o.job.backend, o.job.fmt, o.kernel) for o in report.outcomes if o.job.compile and o.kernel}
    resolved = [o for o in report.outcomes if o.ok and o.kernel and o.knobs is not None and o.job.stage == "resolve"]
    jobs: List[Job] = []
    for pair, names in classes.items():
        own = [o for o in resolved if (o.job.backend, o.job.fmt) == pair]
        spaces = {o.knobs.get("kernel") for o in own}
        for name in names:
            if (pair[0], pair[1], name) in compiled:
                continue
            donors = [o for o in own if o.kernel == name] + [
                o for o in resolved if o.kernel == name and (o.job.backend, o.job.fmt) != pair
                and o.knobs.get("kernel") in spaces]
            if not donors:
                continue
            d = donors[0]
            jobs.append(Job(id=start + len(jobs), backend=pair[0], fmt=pair[1], capacity=d.job.capacity, compile=True,
                            knobs=d.knobs, world_size=d.job.world_size,
                            source=f"{name}: knobs of {d.job.backend} [{d.job.fmt}] {d.job.source} at capacity "
                                   f"{d.job.capacity}"))
    return jobs


def uncovered(report: BuildReport, classes: Dict[Pair, Sequence[str]]) -> List[Tuple[Pair, str]]:
    """(pair, kernel class) no compile of the report built (no knob set in reach selects it)."""
    compiled = {(o.job.backend, o.job.fmt, o.kernel) for o in report.outcomes if o.job.compile and o.kernel}
    return [(pair, n) for pair, names in classes.items() for n in names if (pair[0], pair[1], n) not in compiled]


# ---- the verdict cache: one build per tree digest, shim and plan ------------------------------------------------

CACHE_VERSION = 1
# What the children import from the checkout: a change anywhere here can change a verdict.
_SOURCES = ("shim", "moe_ep", "tools/drop")


def _digest_files(root: Path, rels) -> str:
    h = hashlib.sha256()
    for rel in sorted(rels):
        h.update(rel.encode() + b"\0" + hashlib.sha256((root / rel).read_bytes()).digest())
    return h.hexdigest()


def cache_key(repo: Path, tree: TreeFacts, tree_root: Path, jobs: Sequence[Job], classes) -> str:
    """sha256 over the candidate tree's files, the checkout's sources the children import, the plan, and the
    interpreter, torch and CuTe DSL versions: equal keys give equal verdicts."""
    from importlib import metadata

    tree_root, repo = Path(tree_root), Path(repo)
    tree_files = [p.relative_to(tree_root).as_posix() for p in tree_root.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith((".pyc", ".pyo"))]
    sources = [p.relative_to(repo).as_posix() for d in _SOURCES for p in (repo / d).rglob("*.py")
               if "__pycache__" not in p.parts]
    versions = {}
    for dist in ("torch", "nvidia-cutlass-dsl"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    blob = json.dumps({"v": CACHE_VERSION, "arch": tree.arch, "tree": _digest_files(tree_root, tree_files),
                       "sources": _digest_files(repo, sources), "python": sys.version, "versions": versions,
                       "cute_arch": tree.cute_arch, "jobs": [dataclasses.asdict(j) for j in jobs],
                       "classes": sorted((list(k), list(v)) for k, v in classes.items())}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _cache_file(cache_dir: Path, arch: str, key: str) -> Path:
    return Path(cache_dir) / "build" / f"{arch}-{key[:40]}.json"


def _load_cached(path: Path, arch: str, pairs: List[Pair]) -> Optional[BuildReport]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        outcomes = [Outcome.from_json(o) for o in data["outcomes"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return BuildReport(arch, pairs, outcomes, float(data.get("wall_s", 0.0)), int(data.get("compile_jobs", 1)),
                       cached=str(path))


def _save(path: Path, report: BuildReport) -> None:
    if any("the build child" in o.error and "before this job reported" in o.error for o in report.outcomes):
        return  # a child that died or overran may not do so again: never keep that verdict
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"wall_s": report.wall_s, "compile_jobs": report.compile_jobs,
                               "outcomes": [o.to_json() for o in report.outcomes]}), encoding="utf-8")
    os.replace(tmp, path)


def run_stage(repo: Path, tree: TreeFacts, tree_root: Path, jobs: List[Job], *, classes: Dict[Pair, Sequence[str]],
              compile: bool = True, compile_jobs: int = 1, cache_dir: Optional[Path] = None, rebuild: bool = False,
              log: Callable[[str], None] = print) -> BuildReport:
    """The build stage of one tree: the planned jobs, then (when compiling) a compile of every kernel class a pair can
    select that they did not build (cover_jobs). Its report is kept in `cache_dir` under cache_key, and read back
    instead of built again while the tree, the checkout's sources and the plan are the same (a bump right after its
    audit), unless `rebuild`."""
    path = _cache_file(cache_dir, tree.arch, cache_key(repo, tree, tree_root, jobs, classes if compile else {})) \
        if cache_dir is not None else None
    pairs = list(dict.fromkeys((j.backend, j.fmt) for j in jobs))
    if path is not None and not rebuild and path.is_file():
        report = _load_cached(path, tree.arch, pairs)
        if report is not None:
            log(f"{tree.arch}: build stage: the verdict of an identical tree, shim and plan, read from the cache "
                f"({path.parent}; --rebuild runs it again)")
            return report
    report = run_build(repo, tree, tree_root, jobs, compile_jobs=compile_jobs, log=log)
    if compile:
        more = cover_jobs(report, classes, start=len(jobs))
        if more:
            extra = run_build(repo, tree, tree_root, more, compile_jobs=compile_jobs, log=log)
            report = BuildReport(tree.arch, pairs, report.outcomes + extra.outcomes, report.wall_s + extra.wall_s,
                                 max(report.compile_jobs, extra.compile_jobs))
    if path is not None:
        _save(path, report)
    return report


# ---- what it means for the audit ----------------------------------------------------------------


def build_findings(report: BuildReport):
    """(status, subject, detail, sites, pairs) per distinct failure: resolve failures grouped over capacities."""
    out = []
    groups: Dict[tuple, List[Outcome]] = {}
    for o in report.outcomes:
        if not o.ok:
            key = (o.job.backend, o.job.fmt, o.stage, o.job.knobs is not None, o.error, o.shim_site, o.drop_site,
                   o.job.in_use)
            groups.setdefault(key, []).append(o)
    for (backend, fmt, stage, row, error, shim_site, drop_site, in_use), items in groups.items():
        caps = _ranges([o.job.capacity for o in items])
        what = {"compile": "compile", "numbers": "numerical check"}.get(stage, "knob resolution and kernel build")
        subject = f"{backend} [{fmt}] {what}" + ("" if stage == "numbers" else f" at capacity {caps}")
        if row:
            subject += f" ({len(items)} shipped table row(s){'' if in_use else ', measured on another drop'})"
        detail = error + (f" (raised in the drop at {drop_site})" if drop_site else "")
        if not in_use:
            detail += "; those rows are not used with this drop: retune them"
        out.append(("break" if in_use else "warn", subject, detail, (shim_site,) if shim_site else (),
                    ((backend, fmt),)))
    return out


def note_skipped(result, why: str) -> None:
    """A warning that a part of the build stage did not run (its verdict is not known): every pair."""
    from tools.drop.audit import Finding

    result.findings.append(Finding("build", "warn", "build stage not run in full", why, (), tuple(result.all_pairs())))


def apply_build(result, report: BuildReport) -> None:
    """Adds the build's findings to an AuditResult and downgrades the static breaks it contradicts."""
    from tools.drop.audit import STATUS_ORDER, SECTION_ORDER, Finding

    findings = []
    built = {p for p in report.pairs if report.builds(p)}
    for f in result.findings:
        if (f.status == "break" and f.section in BUILD_CHECKED_SECTIONS and f.pairs
                and set(f.pairs) <= built):
            names = ", ".join(sorted({b for b, _ in f.pairs}))
            f = dataclasses.replace(f, status="warn", detail=f"{f.detail}; static check only: {names} resolve(s) and "
                                                                  "compile(s) against this drop (see the build stage)")
        findings.append(f)
    for status, subject, detail, sites, pairs in build_findings(report):
        findings.append(Finding("build", status, subject, detail, sites, pairs))
    findings.sort(key=lambda f: (STATUS_ORDER[f.status], SECTION_ORDER[f.section], f.subject))
    result.findings = findings
    result.build = report
