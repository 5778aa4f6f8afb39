"""A Kafka-protocol broker on this machine, for the tests and bench.kafka: noida-db (a test extra, pinned in
pyproject.toml) on a free port of 127.0.0.1 with a data folder of its own, stopped with `noida-db down` (its
wrapper's pid is not the broker's).  Not for production: users point the streams at their own Kafka."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

from deploy.ports import free_port

NOIDA = Path(sys.executable).parent / "noida-db"


class BrokerUnavailable(Exception):
    """noida-db is not installed or does not start; the message says why."""


@contextmanager
def local_broker(data: Path, on: Sequence[str] = (), within: Callable | None = None, host: str = "127.0.0.1"):
    """The broker's bootstrap address while the block runs; `data` holds its one file.  `on`: a command prefix
    that starts it elsewhere (a namespace host, deploy.testbed's `on`), `within(f)`: f() run where that broker's
    `host` (the address it binds) is reached."""
    from confluent_kafka.admin import AdminClient

    port = free_port()
    try:
        up = subprocess.run(up_command(data, port, host, on), capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise BrokerUnavailable(f"noida-db cannot start: {e}") from e
    if up.returncode != 0:
        raise BrokerUnavailable(
            f"noida-db cannot start (exit {up.returncode}): {(up.stderr or up.stdout).strip()[-300:]}"
        )
    bootstrap = f"{host}:{port}"
    try:
        (within or (lambda f: f()))(lambda: AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=20))
        yield bootstrap
    finally:
        subprocess.run([*on, NOIDA, "down", "--data-dir", data], capture_output=True, timeout=60)
        _wait_saved(data)


def _wait_saved(data: Path, timeout: float = 60.0) -> None:
    """`noida-db down` returns while the server still saves its log into `data` (a GB of JSON after a bench):
    wait for that server to exit, so the folder can be removed."""
    import psutil

    servers = []
    for p in psutil.process_iter(["cmdline"]):
        args = p.info["cmdline"] or []
        if "start" in args and str(data) in args:
            servers.append(p)
    psutil.wait_procs(servers, timeout=timeout)


def up_command(data: Path, port: int, host: str = "127.0.0.1", on: Sequence[str] = ()) -> list:
    """`noida-db up` of a broker of Kafka alone on `host`:`port`, its data in `data` (again after a crash: it
    reloads what it had saved)."""
    return [*on, NOIDA, "up", "--data-dir", data, "--host", host, "--only", "kafka", "--kafka-port", str(port)]
