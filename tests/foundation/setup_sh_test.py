"""tools/setup.sh waits (bounded) for another apt/dpkg instead of failing with apt's raw lock error.

Runs the real script against stand-ins on PATH: `apt-get` answers with apt's own lock error a set
number of times (then installs), `dpkg-query` reports bazel-bootstrap once "installed", `sudo` runs
its arguments. Nothing touches the machine's package manager. The script is read from the source
tree (tools/ exports no file label for it); the source digest among the test's data reruns it when
the script changes.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.foundation import nested_bazel

LOCK_ERROR = ("E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (unattended-upgr)\n"
              "E: Unable to acquire the dpkg frontend lock (/var/lib/dpkg/lock-frontend), is another process "
              "using it?")

APT_GET = """#!/bin/bash
state="$STATE_DIR"
echo "$*" >> "$state/apt-calls"
n=$(cat "$state/busy" 2>/dev/null || echo 0)
if [[ "$n" == always || "$n" -gt 0 ]]; then
  [[ "$n" == always ]] || echo $((n - 1)) > "$state/busy"
  printf '%s\\n' "$LOCK_ERROR" >&2
  exit 100
fi
if [[ -n "$OTHER_ERROR" ]]; then echo "E: $OTHER_ERROR" >&2; exit 100; fi
[[ "$1" == install ]] && touch "$state/installed"
exit 0
"""

DPKG_QUERY = """#!/bin/bash
[[ -f "$STATE_DIR/installed" ]] && printf '4.2.3+ds-9' && exit 0
exit 1
"""

FAKE_PYTHON = """#!/bin/bash
[[ "$1" == --version ]] && echo "Python 3.11.9"
exit 0
"""


def _write(path: Path, text: str):
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def machine(tmp_path):
    bin_dir = tmp_path / "bin"
    state = tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    _write(bin_dir / "apt-get", APT_GET)
    _write(bin_dir / "dpkg-query", DPKG_QUERY)
    _write(bin_dir / "sudo", '#!/bin/bash\nexec "$@"\n')
    _write(bin_dir / "bazel", "#!/bin/bash\nexit 0\n")
    _write(bin_dir / "python3.11", FAKE_PYTHON)

    def run(busy, wait_s="30", other_error=""):
        (state / "busy").write_text(str(busy))
        env = {
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "STATE_DIR": str(state),
            "LOCK_ERROR": LOCK_ERROR,
            "OTHER_ERROR": other_error,
            "MOE_EP_PYTHON": str(bin_dir / "python3.11"),
            "MOE_EP_APT_WAIT_S": wait_s,
            "MOE_EP_APT_POLL_S": "0.1",
        }
        script = nested_bazel.workspace_root() / "tools" / "setup.sh"
        proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
        calls = (state / "apt-calls").read_text().splitlines() if (state / "apt-calls").exists() else []
        return proc, calls

    return run


def test_waits_for_the_lock_then_installs(machine):
    proc, calls = machine(busy=3)
    assert proc.returncode == 0, proc.stderr
    assert "waiting for it" in proc.stderr and "held by process 4242" in proc.stderr, proc.stderr
    assert "Could not get lock" not in proc.stderr, "apt's raw error leaked"
    assert [c.split()[0] for c in calls] == ["update"] * 4 + ["install"], calls
    assert "setup: ok (bazel-bootstrap 4.2.3" in proc.stderr


def test_gives_up_after_the_bound_with_what_to_do(machine):
    proc, calls = machine(busy="always", wait_s="1")
    assert proc.returncode == 1
    err = proc.stderr
    assert "still busy after 1s" in err and "held by process 4242 (unattended-upgr)" in err, err
    assert "run tools/setup.sh again" in err and "MOE_EP_APT_WAIT_S" in err, err
    assert "Could not get lock" not in err
    assert all(c.split()[0] == "update" for c in calls) and len(calls) >= 2, calls


def test_other_apt_errors_pass_through_at_once(machine):
    proc, calls = machine(busy=0, other_error="Unable to locate package bazel-bootstrap")
    assert proc.returncode == 100
    assert "E: Unable to locate package bazel-bootstrap" in proc.stderr
    assert len(calls) == 1


def test_nothing_missing_runs_no_apt(machine, tmp_path):
    (tmp_path / "state" / "installed").touch()
    proc, calls = machine(busy="always")
    assert proc.returncode == 0, proc.stderr
    assert calls == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
