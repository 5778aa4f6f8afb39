"""Who may reach the cluster's live endpoints: which binds are loopback, the producers' shared token, and the
configuration as it may be written down (without the token).  Used by protocol.config's checks, the ZeroMQ
source (master/zmq_source.py) and what writes the config to disk (summary, checkpoint manifests)."""
from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from typing import Any


def endpoint_is_local(endpoint: str) -> bool:
    """ipc:// is local; tcp:// (or HOST:PORT) is local when every address its host stands for is loopback: an
    IP literal, a network interface as ZeroMQ binds it (`lo`), else a name, resolved (`localhost.example.com`
    or a name of this host's public address is not local).  A name that does not resolve is not local."""
    if endpoint.startswith("ipc://"):
        return True
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    addresses = _addresses(host)
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def _addresses(host: str) -> list[str]:
    """The addresses a bind to `host` may use, in ZeroMQ's order: wildcard, literal, interface name, name."""
    if host in ("", "*"):
        return ["0.0.0.0"]
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    import psutil  # only for a name: the Spark side reads configs with literal endpoints

    nic = psutil.net_if_addrs().get(host)
    if nic is not None:
        return [a.address for a in nic if a.family in (socket.AF_INET, socket.AF_INET6)]
    try:
        return [info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)]
    except (socket.gaierror, UnicodeError):
        return []


def source_token(cfg: dict[str, dict[str, Any]]) -> str:
    """The producers' shared token ("" = none), from source.token or the file source.token_file."""
    src = cfg["source"]
    return Path(src["token_file"]).read_text().strip() if src["token_file"] else src["token"]


def public(cfg: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`cfg` as written to summary.json and checkpoint manifests: the token masked (never on disk or in logs)."""
    return {**cfg, "source": {**cfg["source"], "token": "***" if cfg["source"]["token"] else ""}}
