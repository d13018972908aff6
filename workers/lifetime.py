"""Processes that must not outlive the process that started them.

A worker killed outright (OOM killer, SIGKILL, a lost Ray actor) runs no cleanup, so its children are told by the
kernel instead: Linux sends them SIGKILL when their parent exits (PR_SET_PDEATHSIG). Without it, vLLM's engine
processes of a SIGKILLed inference server lived on for 15-30 s or more, holding memory and cores.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
_installed = False
_forker = [0]


def prctl(option: int, argument: int | bytes) -> None:
    """Linux's prctl(2) for the calling thread or process; nothing where there is no glibc (as on macOS)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, argument)


def name_this_thread(name: str) -> None:
    """The calling thread's OS name (what `top -H` and /proc/<pid>/task/<tid>/comm show; 15 bytes at most).
    Threads it starts afterwards inherit the name."""
    prctl(PR_SET_NAME, name.encode()[:15])


def signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to process group `pgid` (a child started with start_new_session=True: its pid), if any of it is
    left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def die_with_parent(expected_parent: int | None = None) -> None:
    """This process gets SIGKILL when its parent exits; if `expected_parent` is already gone, it exits now.

    Safe between fork and exec (a `preexec_fn`). The signal follows the thread that started the process: start
    such children from a thread that lives as long as the parent (the main thread)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)  # the parent died before the request took effect


def tie_children_to_this_process() -> None:
    """Every process this one forks or spawns through multiprocessing from now on (and theirs, in turn) dies with
    its parent. Called in each of vLLM's processes of an inference server (see vllm_plugin.register)."""
    global _installed
    if _installed:
        return
    _installed = True
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:  # started by multiprocessing's spawn: tie it now
        die_with_parent(parent.pid)
    os.register_at_fork(before=_remember_forker, after_in_child=_die_with_forker)


def _remember_forker() -> None:
    _forker[0] = os.getpid()


def _die_with_forker() -> None:
    die_with_parent(_forker[0])
