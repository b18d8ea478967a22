"""Atomic file writes that concurrent writers cannot tear.

Every write goes to a temp file with a unique name in the target's own directory (so the rename
is atomic on the same file system), is flushed, then replaces the target with ``os.replace``.
Two processes writing the same path (a parallel sweep sharing a profile cache) each rename a
whole file; a reader sees the old file or a new one, never a torn one. Temp names carry the
writer's pid (``.<name>.<pid>.<random>.tmp``) so temp files left by killed writers are found and
removed the next time anyone writes beside them.
"""
from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

_TMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[^.]+\.tmp$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def clean_stale_temps(directory: Path) -> list[Path]:
    """Remove temp files in ``directory`` whose writer process is gone; returns what was removed."""
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _TMP.match(p.name)
        if m and not _alive(int(m["pid"])):
            with contextlib.suppress(OSError):
                p.unlink()
                removed.append(p)
    return removed


def atomic_write(path: Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` to produce the file, then rename it onto ``path`` atomically.
    The temp file is removed if ``write`` fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (parents created)."""
    def _write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
    return atomic_write(path, _write)
