"""The tests' server ports stay out of the range the kernel hands to ``bind(0)`` and outgoing
connections (tests/server_ports.py says why), and one process never gets the same port twice."""

import socket

from server_ports import _ephemeral_low, free_base_port


def test_ports_are_below_the_ephemeral_range_consecutive_and_not_repeated():
    bases = [free_base_port(3) for _ in range(20)]
    ports = [base + i for base in bases for i in range(3)]
    assert len(set(ports)) == len(ports)
    assert max(ports) < min(_ephemeral_low(), 22000)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_bound_by_another_socket_is_never_handed_out():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        ephemeral = held.getsockname()[1]
        assert ephemeral >= _ephemeral_low()  # what a bare bind(0) pick would be
    taken = []
    try:
        for port in range(10000, 22000, 7):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            taken.append(sock)
        held_ports = {s.getsockname()[1] for s in taken}
        for _ in range(50):
            base = free_base_port(2)
            assert not {base, base + 1} & held_ports
    finally:
        for sock in taken:
            sock.close()
