"""Signalling a child's whole process group: the one helper every part that starts processes uses.

A child started with ``start_new_session=True`` (or ``process_group=0``) leads its own group,
so what it starts (SGLang's scheduler and detokenizer, a reward's or a tool's subprocesses)
can be reached through it even after the child itself has exited.
"""

from __future__ import annotations

import os
import signal
import subprocess


def signal_group(process: subprocess.Popen, sig: int) -> None:
    """Sends ``sig`` to ``process``'s whole group; nothing when the group is gone or not ours."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGKILL to ``process``'s group (the process alone when the group is gone or not ours),
    then reaps it, waiting at most ``timeout_s``: a process in uninterruptible sleep (D state)
    cannot be reaped sooner, and there is nothing more to do for it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
