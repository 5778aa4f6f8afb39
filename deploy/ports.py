"""Ports for the servers a run or a test starts on this machine."""

from __future__ import annotations

import os
import socket
from collections import deque
from pathlib import Path

import numpy as np

#: dispatcher i binds the configured port + i: ports handed out in one process stay this far apart, so that two
#: draws (a stream's port and its ack_endpoint, say) never meet as several dispatchers add to them
SPREAD = 4

#: the ports of the last draws in this process (a test's, or a run's): older ones are closed and may come again
_handed_out: deque[int] = deque(maxlen=256)


def port_range() -> tuple[int, int]:
    """Where free ports are drawn: STREAMJOIN_PORTS ("LOW-HIGH") if set, which gives processes that draw at the
    same time (the test suite's workers) ranges of their own; else 10000 up to the kernel's ephemeral ports
    (net.ipv4.ip_local_port_range): a port that a bind to port 0 hands out may be taken again before the cluster
    binds it, by any outgoing connection or bind to port 0 (MPI's, a client's connection attempts, the metrics
    endpoint's)."""
    given = os.environ.get("STREAMJOIN_PORTS")
    if given:
        low, high = (int(p) for p in given.split("-"))
        return low, high
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    return 10_000, max(low, 20_000)


def free_port(consecutive: int = 1) -> int:
    """A port p with p .. p + consecutive - 1 free now, at least SPREAD away from the ports this process drew
    last: a test lost to a race for a port is no finding."""
    low, high = port_range()
    rng = np.random.default_rng()
    while True:
        port = int(rng.integers(low, high - consecutive - SPREAD))
        span = range(port - SPREAD, port + consecutive + SPREAD)
        if any(p in span for p in _handed_out):
            continue
        try:
            for p in range(port, port + consecutive):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        _handed_out.extend(range(port, port + consecutive))
        return port
