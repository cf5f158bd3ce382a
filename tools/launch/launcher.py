"""Launch N ranks on this machine.

    python -m tools.launch.launcher --nproc 4 --device cpu -- tests/moe_ep/multirank_cpu_test.py -k balanced
    python -m tools.launch.launcher --nproc 2 --device cuda -- -m tools.main --ranks 2

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT (a free port),
MOE_EP_DEVICE (cpu|cuda) and MOE_EP_PG_TIMEOUT_S; moe_ep.init_from_env() joins the group from them (gloo on
CPU, NCCL on CUDA). The command after `--` is pytest arguments, or `-m module args`, or `script.py args`.

From Python, launch_function() runs module:function (or path/to/file.py:function) on every rank and
returns each rank's JSON-able return value; a failing rank raises RankFailure with every rank's output.
CPU ranks that run a Python file or module (`script.py args`, `-m module args`, launch_function's worker) are
forked from a server process that has imported torch once (multiprocessing's forkserver, one per launching
process), and run it as `python` would (runpy, as __main__): a fresh interpreter per rank spent 2-4 s of CPU
importing torch before doing anything, for every rank of every launch. Each forked rank still gets its own
session, environment, working directory, sys.path[0], log and exit code, runs its atexit handlers at its end and
waits for its non-daemon threads; torch's intra-op threads follow its OMP_NUM_THREADS. MOE_EP_LAUNCH_FORK=0
starts fresh interpreters instead; CUDA ranks and `-c` commands always do. As with multiprocessing, a script
that calls launch_function keeps its own top level under `if __name__ == "__main__":` (the forked ranks import
the launching script's main module).

Nothing hangs: when one rank fails the others get a grace period (they are usually blocked in a collective
that can no longer finish) and are then killed; the whole launch has a wall-clock limit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["RankFailure", "RankResult", "TimedRank", "launch", "launch_function", "launch_timed", "free_port",
           "kill_rank", "main"]

_WORKER = str(Path(__file__).resolve().with_name("worker.py"))
_REPO_ROOT = str(Path(__file__).resolve().parents[2])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: Optional[int]  # None: killed by the launcher
    output: str


class RankFailure(RuntimeError):
    def __init__(self, message: str, results: Sequence[RankResult]):
        self.results = list(results)
        tails = "\n".join(f"----- rank {r.rank} (rc={r.returncode}) -----\n{r.output[-4000:]}" for r in results)
        super().__init__(f"{message}\n{tails}")


def _rank_env(rank: int, nproc: int, port: int, device: str, pg_timeout_s: float,
              extra: Optional[Dict[str, str]]) -> Dict[str, str]:
    env = dict(os.environ)
    # The children must import what this process imports (Bazel runfiles, a venv, the repo root).
    paths = [p for p in sys.path if p] + [_REPO_ROOT]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + env.get("PYTHONPATH", "").split(os.pathsep)))
    env.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MOE_EP_DEVICE=device,
               MOE_EP_PG_TIMEOUT_S=str(pg_timeout_s), PYTHONUNBUFFERED="1")
    if device == "cpu":
        # Loopback only, and one intra-op thread per rank: N ranks share this machine's cores.
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("OMP_NUM_THREADS", "1")
    if extra:
        env.update(extra)
    return env


def launch(argv: Sequence[str], nproc: int, *, device: str = "cpu", timeout_s: float = 600.0,
           pg_timeout_s: float = 120.0, grace_s: float = 15.0, env: Optional[Dict[str, str]] = None,
           cwd: Optional[str] = None) -> List[RankResult]:
    """Run `python <argv>` as nproc ranks; returns when all have exited (or were killed)."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":  # one GPU per rank (LOCAL_RANK = rank): refuse here, not once per rank
        from tools.require import check_devices

        check_devices("cuda", count=nproc, argument="device", count_argument="nproc")
    port = free_port()
    logdir = tempfile.mkdtemp(prefix="moe_ep_ranks_")
    procs, logs = [], []
    try:
        _spawn([sys.executable, *argv], [os.path.join(logdir, f"rank{r}.log") for r in range(nproc)], procs, logs,
               port=port, device=device, pg_timeout_s=pg_timeout_s, env=env, cwd=cwd)
        deadline = time.monotonic() + timeout_s
        first_failure = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if first_failure is None and any(c not in (None, 0) for c in codes):
                first_failure = now
            if now > deadline or (first_failure is not None and now - first_failure > grace_s):
                break
            time.sleep(0.05)
        killed = set()
        for r, p in enumerate(procs):
            if p.poll() is None:
                kill_rank(p)
                killed.add(r)
        results = []
        for r, (p, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            text = log.read().decode("utf-8", "replace")
            results.append(RankResult(r, None if r in killed else p.returncode, text))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                kill_rank(p)
        for log in logs:
            log.close()
        # The logs were read into the results: nothing of the launch stays in the temp dir.
        shutil.rmtree(logdir, ignore_errors=True)


def _spawn(cmd: Sequence[str], log_paths: Sequence[str], procs: list, logs: list, *, port: int, device: str,
           pg_timeout_s: float, env: Optional[Dict[str, str]], cwd: Optional[str]) -> None:
    """One rank a log path, each in a session of its own (kill_rank ends it with its children); appends to procs
    and logs as it goes, so the caller's cleanup reaches every rank started before a failure. CPU ranks of a Python
    file or module are forked from the forkserver (see the module docstring)."""
    fork = _forkable(cmd, device)
    for r, path in enumerate(log_paths):
        log = open(path, "w+b")
        logs.append(log)
        rank_env = _rank_env(r, len(log_paths), port, device, pg_timeout_s, env)
        if fork:
            procs.append(_ForkedRank.start(list(cmd[1:]), rank_env, path, cwd))
            continue
        procs.append(subprocess.Popen(list(cmd), env=rank_env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True))


# What the forkserver imports once, before any rank is forked from it: the expensive part of every rank's start.
# (Not moe_ep: it reads some settings from the environment when imported, and each rank has its own.)
_FORK_PRELOAD = ["torch"]


def _forkable(cmd: Sequence[str], device: str) -> bool:
    """[this interpreter, script.py | -m module, ...] on the CPU, unless MOE_EP_LAUNCH_FORK=0."""
    if device != "cpu" or os.environ.get("MOE_EP_LAUNCH_FORK", "1") == "0" or len(cmd) < 2:
        return False
    if os.path.realpath(cmd[0]) != os.path.realpath(sys.executable):
        return False
    return (cmd[1] == "-m" and len(cmd) > 2) or cmd[1].endswith(".py")


def _run_as_python(argv: List[str]) -> None:
    """`python <argv>` for a file or a module, in this process: the same __main__, sys.argv and sys.path[0]."""
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy sets argv[0] to the module's file
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def _forked_rank_main(argv: List[str], env: Dict[str, str], log_path: str, cwd: Optional[str]) -> None:
    """A forked rank: what `python <argv>` with env, its output to log_path and a session of its own would do, in a
    process that already holds torch."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Unbuffered like PYTHONUNBUFFERED=1 (a rank killed at the limit keeps its last lines in the log).
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    import torch

    # torch read OMP_NUM_THREADS when the forkserver imported it; the rank's own value decides here.
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        _run_as_python(argv)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())  # what the interpreter does with an uncaught exception (moe_ep hooks it)
        code = 1
    # How the interpreter ends: wait for non-daemon threads, then the atexit handlers (moe_ep's teardown).
    try:
        import threading

        threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _short_mp_tempdir(mp_util) -> None:
    """multiprocessing puts the forkserver's unix socket in a folder of its own under the temp dir, chosen once per
    process; a socket path has at most 107 bytes, which a Bazel test's TMPDIR (its TEST_TMPDIR, deep in the
    output base) alone can exceed. Choose that folder under /tmp then (multiprocessing removes it at exit)."""
    if len(tempfile.gettempdir()) <= 48 or not os.access("/tmp", os.W_OK):
        return
    saved = tempfile.tempdir
    tempfile.tempdir = "/tmp"
    try:
        mp_util.get_temp_dir()
    finally:
        tempfile.tempdir = saved


class _ForkedRank:
    """A rank forked from the forkserver, with the part of subprocess.Popen's interface that launch() and
    kill_rank() use."""

    _context = None

    def __init__(self, process):
        self._process = process

    @classmethod
    def start(cls, argv: List[str], env: Dict[str, str], log_path: str, cwd: Optional[str]) -> "_ForkedRank":
        if cls._context is None:
            import multiprocessing
            import multiprocessing.util

            _short_mp_tempdir(multiprocessing.util)
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(_FORK_PRELOAD)
            cls._context = ctx
        process = cls._context.Process(target=_forked_rank_main, args=(argv, env, log_path, cwd), daemon=False)
        process.start()
        return cls(process)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        return self._process.exitcode


@dataclass
class TimedRank:
    rank: int
    returncode: Optional[int]  # None: killed at the limit
    exit_t: float  # time.time() when its exit was seen: comparable with the times the ranks themselves record
    output: str


def launch_timed(cmd: Sequence[str], log_paths: Sequence[str], *, device: str, limit_s: float,
                 env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
                 pg_timeout_s: float = 300.0) -> Tuple[float, List[TimedRank]]:
    """Run cmd (argv, interpreter included) as len(log_paths) ranks, each writing its output to its log path (kept),
    and note when each exits; ranks still running after limit_s are hung and killed at once (no SIGTERM first).
    No grace period after a failure: for drivers that time how every rank ends (the watchdog diagnostics).
    Returns the start time (time.time()) and the ranks in order."""
    port = free_port()
    procs: List[subprocess.Popen] = []
    logs: list = []
    exit_t: Dict[int, float] = {}
    killed = set()
    t_start = time.time()
    try:
        _spawn(cmd, log_paths, procs, logs, port=port, device=device, pg_timeout_s=pg_timeout_s, env=env, cwd=cwd)
        while len(exit_t) < len(procs):
            now = time.time()
            for r, p in enumerate(procs):
                if r not in exit_t and p.poll() is not None:
                    exit_t[r] = now
            if now - t_start > limit_s:
                for r, p in enumerate(procs):
                    if r not in exit_t:
                        kill_rank(p, term_grace_s=0, wait_s=10)
                        killed.add(r)
                        exit_t[r] = time.time()
                break
            time.sleep(0.02)
        ranks = []
        for r, (p, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            ranks.append(TimedRank(r, None if r in killed else p.returncode, exit_t[r],
                                   log.read().decode("utf-8", "replace")))
        return t_start, ranks
    finally:
        for p in procs:
            if p.poll() is None:
                kill_rank(p, term_grace_s=0, wait_s=10)
        for log in logs:
            log.close()


def _signal(p, sig) -> None:
    """sig to the rank's process group; to the rank alone if it has none yet (a forked rank is given its session
    by its first statement)."""
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        os.kill(p.pid, sig)


def kill_rank(p: subprocess.Popen, term_grace_s: float = 5.0, wait_s: float = 5.0) -> None:
    """End a rank started with start_new_session=True, children included: SIGTERM to its process group, SIGKILL
    if it is still there after term_grace_s (at once with 0); then wait up to wait_s for it to be reaped.
    Each rank leads its own session, so this reaches its children and nothing else."""
    try:
        if term_grace_s > 0:
            _signal(p, signal.SIGTERM)
            try:
                p.wait(timeout=term_grace_s)
                return
            except subprocess.TimeoutExpired:
                pass
        _signal(p, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass


def launch_function(target: str, nproc: int, kwargs: Optional[Dict[str, Any]] = None, *, device: str = "cpu",
                    timeout_s: float = 600.0, pg_timeout_s: float = 120.0, grace_s: float = 15.0,
                    env: Optional[Dict[str, str]] = None) -> List[Any]:
    """Call target(**kwargs) on every rank (after joining the process group); the list of return values,
    in rank order. target: 'package.module:function' or '/path/to/file.py:function'."""
    with tempfile.TemporaryDirectory(prefix="moe_ep_launch_") as d:
        spec = Path(d) / "call.json"
        spec.write_text(json.dumps({"target": target, "kwargs": kwargs or {}, "result_dir": d}))
        results = launch([_WORKER, str(spec)], nproc, device=device, timeout_s=timeout_s,
                         pg_timeout_s=pg_timeout_s, grace_s=grace_s, env=env)
        bad = [r for r in results if r.returncode != 0]
        if bad:
            raise RankFailure(f"{len(bad)} of {nproc} rank(s) failed running {target}", results)
        out = []
        for r in range(nproc):
            path = Path(d) / f"rank{r}.json"
            if not path.exists():
                raise RankFailure(f"rank {r} exited 0 but wrote no result", results)
            out.append(json.loads(path.read_text())["result"])
        return out


def _split_command(rest: Sequence[str]) -> List[str]:
    rest = list(rest)
    if not rest:
        raise SystemExit("nothing to run: give pytest arguments, '-m module ...' or 'script.py ...' after --")
    if rest[0] == "-m":
        return rest
    first = Path(rest[0])
    if first.suffix == ".py" and not (first.name.startswith("test_") or first.name.endswith("_test.py")):
        return rest
    return ["-m", "pytest", *rest]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        own, rest = argv[:cut], argv[cut + 1:]
    else:
        own, rest = argv, []
    ap = argparse.ArgumentParser(prog="python -m tools.launch.launcher", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--timeout", type=float, default=1800.0, help="wall-clock limit for the whole launch (s)")
    ap.add_argument("--pg-timeout", type=float, default=300.0, help="process-group collective timeout (s)")
    args = ap.parse_args(own)
    if args.device == "cuda":
        from tools.require import require

        require("launcher", "cuda", count=args.nproc, count_argument="--nproc")
    results = launch(_split_command(rest), args.nproc, device=args.device, timeout_s=args.timeout,
                     pg_timeout_s=args.pg_timeout)
    for r in results:
        sys.stdout.write(f"===== rank {r.rank} (rc={r.returncode}) =====\n{r.output}")
        if not r.output.endswith("\n"):
            sys.stdout.write("\n")
    failed = [r.rank for r in results if r.returncode != 0]
    if failed:
        sys.stdout.write(f"FAILED ranks: {failed}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
