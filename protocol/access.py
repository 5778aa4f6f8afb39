"""Who may reach the cluster's live endpoints: which binds are loopback, the producers' shared token, and the
configuration as it may be written down (without the token).  Used by protocol.config's checks, the ZeroMQ
source (master/sources/producers.py) and what writes the config to disk (summary, checkpoint manifests)."""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocol.errors import ConfigError

if TYPE_CHECKING:
    from protocol.plan import Source


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


def source_token(source: Source) -> str:
    """The producers' shared token ("" = none), from source.token or the file source.token_file."""
    return Path(source.token_file).read_text().strip() if source.token_file else source.token


def public(cfg: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`cfg` as written to summary.json and checkpoint manifests: the token and the values of Kafka streams'
    librdkafka settings and the result sink's masked (credentials among them: never on disk or in logs)."""
    out = {**cfg, "source": {**cfg["source"], "token": "***" if cfg["source"]["token"] else ""}}
    if "kafka" in cfg["output"]:  # the result sink's settings (protocol.streams.kafka_sink)
        sink = cfg["output"]["kafka"]
        out["output"] = {**cfg["output"], "kafka": {**sink, "config": dict.fromkeys(sink["config"], "***")}}
    if cfg.get("streams"):
        out["streams"] = {
            name: {**s, "kafka": {**s["kafka"], "config": dict.fromkeys(s["kafka"]["config"], "***")}}
            if s["kafka"]
            else s
            for name, s in cfg["streams"].items()
        }
    return out


def check_http_endpoint(name: str, ep: str, allow_remote: bool) -> None:
    """An HTTP endpoint of metrics (the master's metrics.endpoint, the audit's --metrics): HOST:PORT, off
    loopback only with security.allow_remote (plain HTTP: it has no CURVE, so whoever reaches the port reads
    the metrics)."""
    if not ep:
        return
    host, _, port = ep.rpartition(":")
    if not host or "/" in host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f'{name}: expected HOST:PORT (e.g. 127.0.0.1:9464) or "" (off), got {ep!r}')
    if not endpoint_is_local(ep) and not allow_remote:
        raise ConfigError(f"{name}: {ep!r} is not a loopback address; binding there needs security.allow_remote = true")


def dispatcher_endpoint(endpoint: str, index: int) -> str:
    """Dispatcher `index`'s own socket for a configured endpoint: the port + index (ipc: the path + ".index");
    with several dispatchers each binds its own ingest and result-stream socket."""
    if endpoint.startswith("ipc://"):
        return f"{endpoint}.{index}" if index else endpoint
    host, port = endpoint.rsplit(":", 1)
    return f"{host}:{int(port) + index}"


def check_endpoints(cfg: dict[str, dict[str, Any]]) -> None:
    """ZeroMQ binds: a well-formed endpoint; off loopback only with security.allow_remote and CURVE keys; no
    two binds at one endpoint, counting each dispatcher's own (port + i)."""
    zmq = cfg["source"]["kind"] == "zmq"
    used = [
        (f"{s}.{k}", cfg[s][k])
        for s, k, on in (("source", "endpoint", zmq), ("source", "ack_endpoint", zmq), ("output", "zmq_endpoint", True))
        if on and cfg[s][k]
    ]
    used += [
        (f"streams.{name}.{key}", spec[key])
        for name, spec in cfg.get("streams", {}).items()
        for key in ("endpoint", "ack_endpoint")
        if spec[key]
    ]
    for name, ep in used:
        if not (ep.startswith("ipc://") or (ep.startswith("tcp://") and ":" in ep[6:])):
            raise ConfigError(f"{name}: expected tcp://HOST:PORT or ipc://PATH, got {ep!r}")
    k = cfg["cluster"]["dispatchers"]
    numbered = [(n, e) for n, e in used if e.startswith("ipc://") or e.rpartition(":")[2].isdigit()]  # not port *
    bound = [
        (n if i == 0 else f"{n} (dispatcher {i}'s)", dispatcher_endpoint(e, i)) for n, e in numbered for i in range(k)
    ]
    for name, other, ep in [(n, o, e) for i, (n, e) in enumerate(bound) for o, e2 in bound[:i] if e == e2][:1]:
        raise ConfigError(f"{name}: must differ from {other} (both {ep!r})")
    sec = cfg["security"]
    for name, ep in used:
        if endpoint_is_local(ep):
            continue
        if not sec["allow_remote"]:
            raise ConfigError(
                f"{name}: {ep!r} is not a loopback address; binding there needs "
                "security.allow_remote = true and CURVE keys (security.server_key, security.client_keys)"
            )
        if not sec["server_key"] or not sec["client_keys"]:
            raise ConfigError(
                f"security.server_key: {name} = {ep!r} binds off loopback, so CURVE is required: set "
                "security.server_key (a .key_secret file) and security.client_keys "
                "(a directory of .key files)"
            )
    if sec["server_key"] and not Path(sec["server_key"]).is_file():
        raise ConfigError(f"security.server_key: {sec['server_key']!r} is not a file")
    if sec["server_key"]:
        _check_secret_key(sec["server_key"])
    if sec["server_key"] and not (sec["client_keys"] and Path(sec["client_keys"]).is_dir()):
        raise ConfigError(
            f"security.client_keys: {sec['client_keys']!r} is not a directory of client public keys "
            "(needed with security.server_key)"
        )


def check_producers(cfg: dict[str, dict[str, Any]]) -> None:
    """The shared token (in the config or a file) and the acknowledgement channel (master/sources/producers.py)."""
    src = cfg["source"]
    if src["token"] and src["token_file"]:
        raise ConfigError("source.token_file: give the token either in source.token or in source.token_file, not both")
    try:
        if src["token_file"] and not Path(src["token_file"]).read_text().strip():
            raise ConfigError(f"source.token_file: {src['token_file']!r} is empty")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"source.token_file: cannot read {src['token_file']!r} ({e})") from None
    streams = cfg.get("streams", {})
    acks = ["source.ack_endpoint"] * bool(src["ack_endpoint"] and src["kind"] == "zmq") + [
        f"streams.{name}.ack_endpoint" for name, spec in streams.items() if spec["ack_endpoint"]
    ]
    if acks and not cfg["checkpoint"]["interval"]:
        raise ConfigError(f"{acks[0]}: acknowledgements come from checkpoints: set checkpoint.interval")
    for name in [n for n, spec in streams.items() if spec["ack_endpoint"] and not spec["endpoint"]][:1]:
        raise ConfigError(f"streams.{name}.ack_endpoint: only for a live stream's producers (streams.{name}.endpoint)")


def _check_secret_key(path: str) -> None:
    """The server's certificate must hold its secret key: a public one (`.key`) failed deep in ZeroMQ's setup."""
    import zmq.auth  # only when CURVE is configured: the control side reads configs without pyzmq's setup

    try:
        secret = zmq.auth.load_certificate(path)[1]
    except (OSError, ValueError) as e:
        raise ConfigError(f"security.server_key: {path!r} is not a ZeroMQ certificate ({e})") from None
    if secret is None:
        raise ConfigError(
            f"security.server_key: {path!r} holds only a public key: give the secret certificate "
            "(the .key_secret file zmq.auth.create_certificates wrote)"
        )
