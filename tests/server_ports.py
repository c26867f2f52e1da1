"""Ports for the servers the tests start, picked below the kernel's ephemeral range.

``bind(0)`` hands out a port from the ephemeral range (32768-60999 by default), the range the
kernel also gives every outgoing connection and every listener bound to port 0 (Gloo's pairs,
TCP stores, gRPC coordinators). A test that takes such a port and lets a server bind it only after
tens of seconds of start-up races all of them: on a loaded CI machine an SGLang server's uvicorn
found its port taken and exited with code 3 (a bare ``bind(0)`` pick, in test_cluster_rl).
SGLang keeps its own late-bound ports below the range for the same reason (22000-29999); the
tests pick theirs from 10000-21999, at random so that two xdist workers rarely meet, and never
hand out a port twice in one process (fleets started side by side have not bound theirs yet).
"""

from __future__ import annotations

import random
import socket

_LOW, _HIGH = 10000, 22000  # SGLang's own picks start at 22000
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_base_port(count: int = 1) -> int:
    """A port ``p`` with ``p .. p + count - 1`` free now, below the ephemeral range, and not
    handed out before by this process."""
    high = min(_HIGH, _ephemeral_low()) - count
    for base in random.sample(range(_LOW, high), 200):
        ports = set(range(base, base + count))
        if not ports & _handed_out and all(map(_free, ports)):
            _handed_out.update(ports)
            return base
    raise RuntimeError(f"no {count} consecutive free ports in {_LOW}-{high + count}")
