"""One jaxrl process of the cluster tests: ``python cluster_worker.py KILL_AT [jaxrl train arguments]``.

Runs ``jaxrl train`` as its command line does (placement, joining, the trainer). ``KILL_AT`` > 0:
on the last process, just before this process sends its ``KILL_AT``-th rollout request (``/generate``, the
push's one-token probes not counted), its SGLang
server is killed (SIGKILL to the server's process group, as a crash or the OOM killer would), so
the kill lands in the middle of a rollout whatever the machine's speed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import urllib.parse


def _server_group(port: int) -> int:
    """The process group of the SGLang server listening on ``port`` (its launcher leads it)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode() and b"-c" in argv:
            return os.getpgid(int(pid))
    raise RuntimeError(f"no SGLang server listens on port {port}")


def _kill_mid_rollout(kill_at: int) -> None:
    import jax

    from jaxrl.rollout.sglang.client import SGLangClient

    request, sent, lock = SGLangClient.request, [0], threading.Lock()

    def counting_request(self, server, method, route, payload, name):
        rollout = route == "/generate" and payload["sampling_params"]["max_new_tokens"] > 1  # not a probe
        if rollout and jax.process_index() == jax.process_count() - 1:
            with lock:
                sent[0] += 1
                now = sent[0] == kill_at
            if now:
                port = urllib.parse.urlsplit(self.urls[server]).port
                os.killpg(_server_group(port), signal.SIGKILL)
                print(f"cluster_worker: killed the server on port {port} before /generate request {kill_at}",
                      flush=True)
        return request(self, server, method, route, payload, name)

    SGLangClient.request = counting_request


def main(argv: list[str]) -> int:
    kill_at = int(argv[0])
    if kill_at:
        _kill_mid_rollout(kill_at)
    from jaxrl.trainer.cli import train_main

    return train_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
