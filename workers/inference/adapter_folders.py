"""Where inference servers keep the adapter versions they load: one folder per server process on tmpfs, named
by its PID, so that the folders of servers killed outright (which never remove their own, 20-40 MB each) can be
told from live ones and removed. Torch-free: `grpolora run` cleans up with it when it ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

ADAPTER_ROOT_PREFIX = "grpolora-adapters-"


def adapter_base() -> Path:
    """Adapters are small and written once per round: tmpfs keeps that off the disk."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def default_adapter_root(tag: str) -> Path:
    """One folder per server process, named by its PID, so that leftovers can be told from live ones."""
    return adapter_base() / f"{ADAPTER_ROOT_PREFIX}{tag}-{os.getpid()}"


def remove_stale_adapter_roots(base: Path | None = None) -> list[Path]:
    """Remove the adapter folders of server processes that no longer exist (a server killed outright never
    removes its own, 20-40 MB of tmpfs each). Called when a server starts and when `grpolora run` ends."""
    removed = []
    for folder in (base or adapter_base()).glob(f"{ADAPTER_ROOT_PREFIX}*-*"):
        pid = folder.name.rsplit("-", 1)[1]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
