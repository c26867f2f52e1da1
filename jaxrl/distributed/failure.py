"""A failure in one process stops all of them with that process's error (:func:`stop_all_on_failure`)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import traceback
from typing import Iterator

import jax

# Keys in the coordination service's key-value store used to pass a failure.
_FAILURE_KEY = "jaxrl/failure"
_FAILURE_ACK_KEY = "jaxrl/failure_ack/{}"
# How long a failing process waits for the others to read its error before it exits.
_FAILURE_ACK_TIMEOUT_S = 10.0
_FAILURE_POLL_S = 0.5  # per process, against the coordinator: keep it light for large pods
_EXIT_GRACE_S = 1.0  # process 0's wait for the others to exit first


def _jax_state():
    """JAX's distributed state: the coordination client and address live only in this private global."""
    from jax._src import distributed as jax_distributed  # noqa: PLC0415

    return jax_distributed.global_state


def _coordination_client():
    """The coordination service's client (its key-value store), or None with one process."""
    return _jax_state().client


class _FailureWatch:
    """Polls the key-value store for another process's failure and exits this one with it."""

    def __init__(self, client, process_index: int, coordinator_address: str | None):
        self._client = client
        self._process_index = process_index
        self._address = coordinator_address
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxrl-failure-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        unreachable_since = None
        while not self._stop.wait(_FAILURE_POLL_S):
            try:
                message = self._client.key_value_try_get(_FAILURE_KEY)
            except Exception as error:  # NOT_FOUND until someone fails; other errors: lost the coordinator
                if str(error).startswith("NOT_FOUND"):
                    unreachable_since = None
                    continue
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > 5.0 and not self._stop.is_set():
                    self._exit(
                        f"lost the coordinator at {self._address} (process 0), which most likely failed; "
                        f"see process 0's log. Last error: {error}"
                    )
                continue
            if self._stop.is_set():
                return
            self._exit(message, acknowledge=True)

    def _exit(self, message: str, acknowledge: bool = False) -> None:
        """Prints why and exits with status 1; the acknowledgement, which lets the failed process
        exit, comes after the print, and process 0 leaves last (:func:`_exit_last_if_coordinator`)."""
        print(f"jaxrl.distributed: process {self._process_index} stops because {message}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        if acknowledge:
            with contextlib.suppress(Exception):
                self._client.key_value_set(_FAILURE_ACK_KEY.format(self._process_index), "1")
            _exit_last_if_coordinator(self._process_index)
        os._exit(1)


def _exit_last_if_coordinator(process_index: int) -> None:
    """Process 0 hosts the coordination service: once it is gone, JAX's agent in every other process
    aborts it (SIGABRT, "detected fatal errors") instead of letting it exit with its own error. So
    process 0 waits a moment for the others, which exit as soon as they have printed."""
    if process_index == 0:
        time.sleep(_EXIT_GRACE_S)


@contextlib.contextmanager
def stop_all_on_failure() -> Iterator[None]:
    """Makes an exception in one process stop every process, each printing that process's error.

    Without it the others wait in their next collective until the
    coordinator's heartbeat gives up (minutes), with no word of the cause.
    The failing process publishes its traceback, waits briefly for the others
    to read it, prints it and exits with status 1 (``os._exit``: a normal exit
    would hang in JAX's shutdown barrier, which the others never reach). With
    one process the exception propagates as usual.
    """
    client = _coordination_client()
    if client is None or jax.process_count() == 1:
        yield
        return
    index, count = jax.process_index(), jax.process_count()
    watch = _FailureWatch(client, index, _jax_state().coordinator_address)
    watch.start()
    try:
        yield
    except BaseException as error:
        if isinstance(error, SystemExit) and error.code in (None, 0):
            raise
        watch.stop()
        details = "".join(traceback.format_exception(error))
        message = f"process {index} ({socket.gethostname()}) failed:\n{details}"
        with contextlib.suppress(Exception):  # another process may have failed first
            client.key_value_set(_FAILURE_KEY, message)
        deadline = time.monotonic() + _FAILURE_ACK_TIMEOUT_S
        for other in range(count):
            remaining_ms = int(1000 * (deadline - time.monotonic()))
            if other != index and remaining_ms > 0:
                with contextlib.suppress(Exception):
                    client.blocking_key_value_get(_FAILURE_ACK_KEY.format(other), remaining_ms)
        print(f"jaxrl.distributed: {message}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        _exit_last_if_coordinator(index)
        os._exit(1)
    finally:
        watch.stop()
