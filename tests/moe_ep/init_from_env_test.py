"""moe_ep.init_from_env: one process needs no environment at all; anything partial or malformed gets a typed
error that names the variable and says what to set.

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
import json, os, sys
import torch.distributed as dist
import moe_ep
ctx = moe_ep.init_from_env()
again = moe_ep.init_from_env()
print(json.dumps({"rank": ctx.rank, "world_size": ctx.world_size, "pg_backend": ctx.pg_backend,
                  "device": str(ctx.device), "idempotent": again.rank == ctx.rank and dist.is_initialized(),
                  "env_port": os.environ.get("MASTER_PORT"), "env_rank": os.environ.get("RANK")}))
dist.barrier()  # leave together: a gloo rank exiting mid-teardown can abort its peer
dist.destroy_process_group()
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
