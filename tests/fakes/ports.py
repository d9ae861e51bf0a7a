"""Ports for the servers a test starts in processes of their own (gateways, Redis, engines)."""

from __future__ import annotations

import collections
import random
import socket
from pathlib import Path


def _outgoing_low() -> int:
    """The lowest port the kernel gives outgoing connections (Linux), or 0 where unknown."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


# The OS's generator, not the process's: a test that seeds ``random`` (tests/test_request_id.py,
# in each xdist worker) made every worker draw the same ports, and two gateways started on one.
_DRAW = random.SystemRandom()
# The ports this process gave out lately: free when drawn, but not bound until the process
# started on it binds, so a second draw could give one out again (two instances of one test
# drew one port; the second could not listen: "Address already in use", a CI run).
_GIVEN: collections.deque[int] = collections.deque(maxlen=512)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a process started next to bind on ``host``: below the kernel's
    range for outgoing connections where it is known (a port bound to 0 is taken from that
    range, and one of the suite's many client connections took it before the gateway bound it:
    "Address already in use"), drawn at random (the OS's generator) so that parallel tests
    seldom draw the same, checked free, and not one this process gave out lately."""
    low = _outgoing_low()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(200 if low > 11_024 else 0):
        port = _DRAW.randrange(10_000, low)
        if port in _GIVEN:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            _GIVEN.append(port)
            return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
