"""All of a bump's file writes, or none of them.

A bump computes every file it will write (pin, manifest, contract, docs, report) in memory
first; `Transaction.commit` then replaces them one by one (each through a temporary file and an
atomic rename) and, if anything goes wrong on the way -- an error, Ctrl-C, SIGTERM -- puts back
the files it had already replaced and removes the ones it had created. Only a hard kill
(SIGKILL, power loss) in the middle of the handful of renames can leave a mix; `git status`
shows it then, and `git checkout -- <paths>` undoes it.
"""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

__all__ = ["Transaction"]


class _Terminated(BaseException):
    pass


def _raise_terminated(signum, frame):  # pragma: no cover - exercised through the test's direct raise
    raise _Terminated(f"signal {signum}")


class Transaction:
    # The atomic rename of one file (a test replaces it to fail part-way).
    replace: Callable[[str, str], None] = staticmethod(os.replace)

    def __init__(self, repo_root: Path):
        self.repo = Path(repo_root)
        self._writes: Dict[Path, str] = {}

    def write(self, path: Path, text: str) -> None:
        self._writes[Path(path)] = text

    @property
    def paths(self) -> List[Path]:
        return list(self._writes)

    def changed(self) -> List[Path]:
        """The paths whose content the commit would change."""
        return [p for p, text in self._writes.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]

    def commit(self) -> List[Path]:
        done: List[Tuple[Path, Optional[bytes]]] = []
        previous = None
        try:
            try:
                previous = signal.signal(signal.SIGTERM, _raise_terminated)
            except ValueError:  # not the main thread: SIGTERM keeps its handler
                previous = None
            for path, text in self._writes.items():
                old = path.read_bytes() if path.is_file() else None
                if old is not None and old == text.encode("utf-8"):
                    continue
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        f.write(text)
                    if old is not None:
                        os.chmod(tmp, path.stat().st_mode & 0o777)
                    self.replace(tmp, str(path))
                except BaseException:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                    raise
                done.append((path, old))
        except BaseException:
            for path, old in reversed(done):
                if old is None:
                    path.unlink(missing_ok=True)
                else:
                    path.write_bytes(old)
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        return [p for p, _ in done]
