"""moe_ep.init_from_env: one process needs no environment at all; anything partial or malformed gets a typed
error that names the variable and says what to set. On a host with CUDA devices it takes this rank's GPU and
NCCL unless MOE_EP_DEVICE=cpu says otherwise (said once, on rank 0); the group it made is destroyed at the end
of a normal run, a group the caller made is left alone.

The cases that join a group run in a child process each (a process joins the default group once); the
error cases fail before any group is created, so they run here.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

import moe_ep
from moe_ep.core.dist import ProcessGroupEnvError

GROUP_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MOE_EP_DEVICE",
              "MOE_EP_PG_TIMEOUT_S")

_CHILD = """
import json, os, sys, warnings
import torch.distributed as dist
import moe_ep
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    ctx = moe_ep.init_from_env()
    again = moe_ep.init_from_env()
print(json.dumps({"said": [str(w.message) for w in seen if "moe_ep" in str(w.message)],
                  "rank": ctx.rank, "world_size": ctx.world_size, "pg_backend": ctx.pg_backend,
                  "device": str(ctx.device), "idempotent": again.rank == ctx.rank and dist.is_initialized(),
                  "env_port": os.environ.get("MASTER_PORT"), "env_rank": os.environ.get("RANK")}))
dist.barrier()  # leave together: a gloo rank exiting mid-teardown can abort its peer
dist.destroy_process_group()
"""


# A rank on a host that (fakes that it) has two GPUs, with MOE_EP_DEVICE=cpu: the group is real (gloo), and what
# init_from_env says about the CPU is recorded.
_CPU_ON_GPU_HOST_CHILD = """
import json, warnings
import torch, torch.distributed as dist
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 2
import moe_ep
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    ctx = moe_ep.init_from_env()
    moe_ep.init_from_env()
said = [str(w.message) for w in seen if "moe_ep" in str(w.message)]
print(json.dumps({"device": str(ctx.device), "pg_backend": ctx.pg_backend, "said": said}))
dist.barrier()
"""

# A child that ends without tearing anything down: what moe_ep destroys at exit shows on stdout.
_EXIT_CHILD = """
import os, sys, tempfile, datetime
import torch.distributed as dist
real_destroy = dist.destroy_process_group
def destroy(*a, **k):
    print("destroyed", flush=True)
    real_destroy(*a, **k)
dist.destroy_process_group = destroy
if os.environ.get("OWN_GROUP") == "1":
    d = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
import moe_ep
ctx = moe_ep.init_from_env()
print("joined", ctx.world_size, flush=True)
if os.environ.get("CRASH") == "1":
    raise RuntimeError("the run fails")
"""


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in GROUP_VARS}
    env.update(extra)
    return env


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(env):
    return subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"child failed (exit {proc.returncode}):\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def env(monkeypatch):
    for var in GROUP_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_one_process_without_any_variable_is_world_size_1():
    r = _result(_spawn(_clean_env()))
    assert (r["rank"], r["world_size"], r["pg_backend"], r["device"]) == (0, 1, "gloo", "cpu")
    assert r["idempotent"]
    assert r["said"] == []  # a host without a GPU: the CPU is no choice, nothing to say
    # The picked port is not written back: a process this one starts must not inherit it.
    assert r["env_port"] is None and r["env_rank"] is None


def test_rank_0_of_world_1_needs_no_master_address():
    r = _result(_spawn(_clean_env(RANK="0", WORLD_SIZE="1")))
    assert (r["rank"], r["world_size"]) == (0, 1)


def test_two_ranks_from_torchrun_style_variables():
    port = str(_free_port())
    procs = [_spawn(_clean_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(2)]
    results = [_result(p) for p in procs]
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)]


class _Asked(Exception):
    """What init_from_env asked torch for, in place of making the group (NCCL needs real GPUs)."""


@pytest.fixture
def gpu_host(env, monkeypatch):
    """This process on a host with `n` (faked) GPUs; returns (set the count, what torch was asked for)."""
    import torch
    import torch.distributed as dist

    asked = {}
    count = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count[0] > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count[0])
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: asked.setdefault("set_device", str(d)))

    def init(backend, **kw):
        asked.update(backend=backend, device_id=str(kw.get("device_id")))
        raise _Asked()

    monkeypatch.setattr(dist, "init_process_group", init)

    def host(n, **variables):
        count[0] = n
        for k, v in variables.items():
            env.setenv(k, v)
        return asked

    return host


def _ask(asked):
    with pytest.raises(_Asked):
        moe_ep.init_from_env()
    return asked


def test_a_gpu_host_gets_its_gpu_and_nccl_by_default(gpu_host):
    r = _ask(gpu_host(2))
    assert (r["backend"], r["device_id"], r["set_device"]) == ("nccl", "cuda:0", "0")


def test_local_rank_picks_the_gpu(gpu_host):
    r = _ask(gpu_host(4, RANK="5", WORLD_SIZE="8", LOCAL_RANK="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999"))
    assert (r["backend"], r["device_id"], r["set_device"]) == ("nccl", "cuda:3", "3")


def test_without_local_rank_the_rank_picks_the_gpu_where_the_host_has_it(gpu_host):
    r = _ask(gpu_host(2, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999"))
    assert r["device_id"] == "cuda:1"


def test_a_rank_past_the_hosts_gpus_without_local_rank_is_a_typed_error(gpu_host):
    asked = gpu_host(2, RANK="3", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    with pytest.raises(moe_ep.errors.DeviceUnavailableError) as info:
        moe_ep.init_from_env()
    assert info.value.argument == "LOCAL_RANK"
    assert "RANK=3" in str(info.value) and "2 CUDA device(s)" in str(info.value), str(info.value)
    assert asked == {}  # refused before torch was asked for anything


def test_a_local_rank_past_the_hosts_gpus_is_a_typed_error(gpu_host):
    asked = gpu_host(2, LOCAL_RANK="2")
    with pytest.raises(moe_ep.errors.DeviceUnavailableError) as info:
        moe_ep.init_from_env()
    assert info.value.argument == "LOCAL_RANK"
    assert "cuda:2" in str(info.value) and "2 CUDA device(s)" in str(info.value), str(info.value)
    assert asked == {}


def test_cuda_asked_on_a_host_without_one_is_a_typed_error(gpu_host):
    asked = gpu_host(0, MOE_EP_DEVICE="cuda")
    with pytest.raises(moe_ep.errors.DeviceUnavailableError) as info:
        moe_ep.init_from_env()
    assert info.value.argument == "MOE_EP_DEVICE" and "no CUDA device" in str(info.value), str(info.value)
    assert asked == {}


def test_the_cpu_on_a_gpu_host_is_said_once_on_rank_0_only():
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _CPU_ON_GPU_HOST_CHILD], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=_clean_env(MOE_EP_DEVICE="cpu", RANK=str(r), WORLD_SIZE="2",
                                             MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(2)]
    r0, r1 = (_result(p) for p in procs)
    assert (r0["device"], r0["pg_backend"]) == ("cpu", "gloo")
    # Two init_from_env calls, one sentence, and it names the variable that chose the CPU.
    assert len(r0["said"]) == 1 and "MOE_EP_DEVICE=cpu" in r0["said"][0] and "2 CUDA device(s)" in r0["said"][0]
    assert r1["said"] == []


@pytest.fixture(scope="module")
def ends():
    """The three ends, run side by side: {case: (exit status, stdout words, stderr)}."""
    cases = {"normal": {}, "own_group": {"OWN_GROUP": "1"}, "crash": {"CRASH": "1"}}
    procs = {k: subprocess.Popen([sys.executable, "-c", _EXIT_CHILD], env=_clean_env(**v), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for k, v in cases.items()}
    out = {}
    for k, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=100)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            pytest.fail(f"the {k!r} child did not end within 100 s:\n{stdout}\n{stderr[-3000:]}", pytrace=False)
        out[k] = (p.returncode, stdout.split(), stderr)
    return out


def test_the_group_init_from_env_made_is_destroyed_at_a_normal_end(ends):
    rc, words, err = ends["normal"]
    assert rc == 0, err[-4000:]
    assert words == ["joined", "1", "destroyed"]
    assert "destroy_process_group" not in err


def test_a_group_the_caller_made_is_left_to_the_caller(ends):
    rc, words, err = ends["own_group"]
    assert rc == 0, err[-4000:]
    assert words == ["joined", "1"]


def test_an_end_on_an_uncaught_exception_tears_nothing_down(ends):
    # Destroying a group waits for peers, and after a failure a peer may never come.
    rc, words, err = ends["crash"]
    assert rc == 1 and "the run fails" in err
    assert words == ["joined", "1"]


@pytest.mark.parametrize(
    "variables, argument, says",
    [
        ({"RANK": "0"}, "WORLD_SIZE", "set WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "RANK", "set RANK"),
        ({"RANK": "zero", "WORLD_SIZE": "2"}, "RANK", "expected an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK", "[0, 2)"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK", "out of range"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE", "number of ranks"),
        ({"RANK": "0", "WORLD_SIZE": ""}, "WORLD_SIZE", "expected an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR", "MASTER_ADDR"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT", "MASTER_PORT"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"}, "MASTER_PORT",
         "free TCP port"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT", "out of range"),
        ({"MOE_EP_PG_TIMEOUT_S": "soon"}, "MOE_EP_PG_TIMEOUT_S", "seconds"),
        ({"MOE_EP_DEVICE": "gpu"}, "MOE_EP_DEVICE", "'cuda'"),
    ],
)
def test_partial_or_malformed_environment_is_a_typed_error(env, variables, argument, says):
    for k, v in variables.items():
        env.setenv(k, v)
    with pytest.raises(ProcessGroupEnvError) as info:
        moe_ep.init_from_env()
    err = info.value
    assert err.argument == argument
    assert argument in str(err) and says in str(err), str(err)
    # Typed, and still what a caller would catch without knowing the new class.
    assert isinstance(err, moe_ep.ProcessGroupError) and isinstance(err, moe_ep.MoEError)
    assert isinstance(err, RuntimeError) and not isinstance(err, KeyError)


def test_bad_timeout_argument_is_a_typed_error(env):
    with pytest.raises(ProcessGroupEnvError) as info:
        moe_ep.init_from_env(timeout_s=0)
    assert info.value.argument == "timeout_s"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
