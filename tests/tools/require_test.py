"""The tools' answer to an absent device: one line on stderr and exit status 2, from the main job, the launcher
and the GPU tools alike (tools/require.py), before any rank starts. On this host (no GPU) for real; GPU hosts of
another arch or with fewer GPUs are faked through torch.cuda."""

import os
import subprocess
import sys

import pytest
import torch

from tools import require as req

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("MOE_EP_DEVICE", None)
    return subprocess.run([sys.executable, *args], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without a GPU is what this case is about")
@pytest.mark.parametrize("args, says", [
    (["-m", "tools.main", "--device", "cuda"], "main: argument '--device': cuda was asked for, but this host has "
                                               "no CUDA device"),
    (["-m", "tools.launch.launcher", "--nproc", "2", "--device", "cuda", "--", "-m", "tools.main"],
     "launcher: argument '--device': cuda was asked for"),
])
def test_an_absent_device_is_one_line_and_exit_2(args, says):
    proc = _run(*args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(says), proc.stderr
    assert proc.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without a GPU is what this case is about")
def test_the_gpu_tools_on_a_host_without_one(capsys):
    from tools import main as main_job
    from tools.bench.bench import main as bench
    from tools.tune.tune import main as tune

    line = _one_line_exit(capsys, lambda: main_job.main(["--backend", "sm90_fp8_cutedsl"]))
    assert line.startswith("main: argument '--backend': backend 'sm90_fp8_cutedsl' runs on an sm90 GPU"), line
    assert "device is cpu" in line, line
    for tool in (lambda: bench(["--quick"]), lambda: tune([])):
        line = _one_line_exit(capsys, tool)
        assert "cuda was asked for, but this host has no CUDA device" in line, line


def _fake_gpus(monkeypatch, *caps, name="NVIDIA H200"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(caps))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: caps[0 if i is None else int(i)])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _one_line_exit(capsys, fn):
    with pytest.raises(SystemExit) as info:
        fn()
    assert info.value.code == req.EXIT_ABSENT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_fewer_gpus_than_ranks(monkeypatch, capsys):
    _fake_gpus(monkeypatch, (9, 0), (9, 0))
    from tools import main as main_job

    line = _one_line_exit(capsys, lambda: main_job.main(["--device", "cuda", "--ranks", "4"]))
    assert line.startswith("main: argument '--ranks': cuda:0..cuda:3 (4 GPUs) are needed, but this host has 2 CUDA "
                           "device(s)"), line


def test_a_gpu_of_another_arch(monkeypatch, capsys):
    _fake_gpus(monkeypatch, (10, 0), name="NVIDIA B200")
    from tools import main as main_job

    line = _one_line_exit(capsys, lambda: main_job.main(["--backend", "sm90_fp8_cutedsl", "--ranks", "1"]))
    assert "cuda:0 is NVIDIA B200 (sm100)" in line, line
    line = _one_line_exit(capsys, lambda: req.require("tune", first=0, arch="sm90", backend="sm90_fp8_cutedsl",
                                                      argument=None, arch_argument=None))
    assert line.startswith("tune: backend 'sm90_fp8_cutedsl' runs on an sm90 GPU"), line


def test_the_asked_gpus_present_pass(monkeypatch):
    _fake_gpus(monkeypatch, (9, 0), (9, 0))
    req.check_devices("cuda", count=2, arch="sm90", backend="sm90_fp8_cutedsl")
    req.check_devices("cuda", first=1, arch="sm90")
    req.check_devices("cpu", count=8)


def test_the_launcher_refuses_before_starting_a_rank(monkeypatch):
    from moe_ep.errors import DeviceUnavailableError
    from tools.launch.launcher import launch

    _fake_gpus(monkeypatch, (9, 0))
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(DeviceUnavailableError) as info:
        launch(["-c", "pass"], 2, device="cuda")
    assert info.value.argument == "nproc" and not started


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
