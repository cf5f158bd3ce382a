"""What the checkpoint tools measure in a fresh Python process, so that nothing the caller holds counts: the
process's own memory counters, and a call of a module's function in a child that prints its JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

__all__ = ["status_bytes", "call"]

_REPO = str(Path(__file__).resolve().parents[2])


def status_bytes(key: str) -> int:
    """A /proc/self/status counter (VmRSS, VmHWM, ...) in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def call(module: str, function: str, kwargs: Dict[str, Any], *, env: Dict[str, str],
         timeout_s: float) -> Tuple[Optional[Any], subprocess.CompletedProcess]:
    """module.function(**kwargs) in a child process with env (and this interpreter's import path, which holds the
    repository root), run from the root: its JSON result (None when it printed none) and the finished process (for
    its return code and output)."""
    env = dict(env, PYTHONPATH=os.pathsep.join([p for p in sys.path if p]))
    code = (f"import json, sys; from {module} import {function}; "
            f"print('RESULT ' + json.dumps({function}(**json.loads(sys.argv[1]))), flush=True)")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True, text=True, env=env,
                          timeout=timeout_s, cwd=_REPO)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:]), proc
    return None, proc
