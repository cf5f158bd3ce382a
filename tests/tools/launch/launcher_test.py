"""tools/launch: ranks get torchrun-style env, results come back in rank order, a failing rank fails the launch,
and a launch leaves nothing in the temp dir."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tools.launch.launcher import RankFailure, launch, launch_function

FN = textwrap.dedent("""
    import os
    import torch.distributed as dist

    def whoami(scale):
        t = __import__("torch").tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return {"rank": int(os.environ["RANK"]), "world": dist.get_world_size(), "sum": float(t) * scale}

    def about_me(flag_dir):
        import atexit
        rank = dist.get_rank()
        atexit.register(lambda: open(f"{flag_dir}/rank{rank}.atexit", "w").close())
        return {"rank": dist.get_rank(), "pid": os.getpid(), "sid": os.getsid(0), "ppid": os.getppid(),
                "probe": os.environ.get("MOE_EP_PROBE"), "threads": __import__("torch").get_num_threads()}

    def fail_on_one():
        if dist.get_rank() == 1:
            raise ValueError("rank 1 refuses")
        dist.barrier()  # the others wait for a peer that is gone
        return "unreachable"
""")


@pytest.fixture
def target(tmp_path):
    p = tmp_path / "fns.py"
    p.write_text(FN)
    return str(p)


def test_launch_function_returns_each_ranks_value(target):
    got = launch_function(f"{target}:whoami", 3, {"scale": 2.0})
    assert got == [{"rank": r, "world": 3, "sum": 6.0} for r in range(3)]


def test_cpu_ranks_are_forked_each_in_its_own_session_with_its_env(target, tmp_path):
    got = launch_function(f"{target}:about_me", 2, {"flag_dir": str(tmp_path)}, env={"MOE_EP_PROBE": "x"})
    for r, g in enumerate(got):
        assert g["rank"] == r and g["probe"] == "x" and g["threads"] == 1, g
        assert g["sid"] == g["pid"], g  # a session of its own: kill_rank reaches its children
        assert g["ppid"] != os.getpid(), g  # forked by the forkserver, not started by this process
        assert (tmp_path / f"rank{r}.atexit").exists()  # a normal end runs the rank's atexit handlers


RANK_SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    out = sys.argv[1]
    rank = os.environ["RANK"]
    atexit.register(lambda: open(f"{out}/rank{rank}.atexit", "w").close())
    def hook(kind, value, tb):
        open(f"{out}/rank{rank}.excepthook", "w").write(str(value))
        sys.__excepthook__(kind, value, tb)
    sys.excepthook = hook
    if rank == "0":
        sys.exit(3)
    raise ValueError("rank 1 raises")
""")


def test_a_forked_rank_ends_as_the_interpreter_would(tmp_path):
    # A script run as ranks (forked on the CPU): sys.exit's code, an uncaught exception through sys.excepthook
    # (moe_ep hooks it to leave the group alone), atexit handlers either way.
    script = tmp_path / "rank_script.py"
    script.write_text(RANK_SCRIPT)
    results = launch([str(script), str(tmp_path)], 2, grace_s=30)
    assert [r.returncode for r in results] == [3, 1], results
    assert "ValueError: rank 1 raises" in results[1].output
    assert (tmp_path / "rank1.excepthook").read_text() == "rank 1 raises"
    assert not (tmp_path / "rank0.excepthook").exists()
    assert (tmp_path / "rank0.atexit").exists() and (tmp_path / "rank1.atexit").exists()


def test_a_failing_rank_fails_the_launch_without_hanging(target):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        launch_function(f"{target}:fail_on_one", 3, grace_s=5, pg_timeout_s=30)
    assert time.monotonic() - t0 < 60
    assert "rank 1 refuses" in str(e.value)
    assert e.value.results[1].returncode == 1


def test_cli_runs_pytest_on_every_rank(tmp_path):
    (tmp_path / "test_env.py").write_text(textwrap.dedent("""
        import os
        def test_env():
            assert os.environ["WORLD_SIZE"] == "2" and os.environ["MOE_EP_DEVICE"] == "cpu"
            assert os.environ["MASTER_ADDR"] == "127.0.0.1"
            assert os.environ["RANK"] == os.environ["LOCAL_RANK"]
    """))
    (tmp_path / "test_bad.py").write_text("import os\ndef test_bad():\n    assert os.environ['RANK'] == '0'\n")
    # The launcher's own temp dir (the rank logs) must be gone after a launch, passed or failed.
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), TMPDIR=str(tmp))
    cmd = [sys.executable, "-m", "tools.launch.launcher", "--nproc", "2", "--device", "cpu", "--"]
    ok = subprocess.run(cmd + [str(tmp_path / "test_env.py"), "-q", "-p", "no:cacheprovider"], env=env,
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("1 passed") == 2
    bad = subprocess.run(cmd + [str(tmp_path / "test_bad.py"), "-q", "-p", "no:cacheprovider"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "FAILED ranks: [1]" in bad.stdout
    assert [p.name for p in tmp.iterdir() if p.name.startswith("moe_ep_")] == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
