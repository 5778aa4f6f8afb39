"""Ports for the servers a run or a test starts on this machine."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np


def free_port(consecutive: int = 1) -> int:
    """A port p with p .. p + consecutive - 1 free (dispatcher i binds the configured port + i), drawn below the
    kernel's ephemeral ports (net.ipv4.ip_local_port_range): a port that a bind to port 0 hands out may be taken
    again before the cluster binds it, by any outgoing connection or bind to port 0 (MPI's, a client's
    connection attempts, the metrics endpoint's); a test lost to that race is no finding."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    rng = np.random.default_rng()
    while True:
        port = int(rng.integers(10_000, max(low, 20_000) - consecutive))
        try:
            for p in range(port, port + consecutive):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
