"""ZeroMQ CURVE for the cluster's bound sockets (producer ingest, result stream) and for their clients.

The master's sockets are CURVE servers holding the secret certificate named by
`security.server_key`; a ZAP authenticator lets in only clients whose public
certificate lies in `security.client_keys`.  Certificates are the files
`zmq.auth.create_certificates(dir, name)` writes (`name.key`, `name.key_secret`).
Config validation (protocol.config) already refuses a non-loopback bind without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

if TYPE_CHECKING:
    from protocol.plan import Security

_authenticators: dict[int, ThreadAuthenticator] = {}  #: one ZAP handler per context


def bind_server(sock: zmq.Socket, endpoint: str, security: Security) -> None:
    """Bind `sock` to `endpoint`, as a CURVE server when `security.server_key` is set."""
    if security.server_key:
        ctx = sock.context
        if id(ctx) not in _authenticators:
            auth = ThreadAuthenticator(ctx)
            auth.start()
            auth.configure_curve(domain="*", location=security.client_keys)
            _authenticators[id(ctx)] = auth
        public, secret = zmq.auth.load_certificate(security.server_key)
        sock.curve_publickey, sock.curve_secretkey, sock.curve_server = public, secret, True
    sock.bind(endpoint)


def stop_authenticators() -> None:
    for auth in _authenticators.values():
        auth.stop()
    _authenticators.clear()


def connect_client(sock: zmq.Socket, endpoint: str, server_public: str | None, client_secret: str | None) -> None:
    """Connect `sock`; with both key files given, as a CURVE client of the server with that public key."""
    if bool(server_public) != bool(client_secret):
        raise ValueError("CURVE needs both the server's public key file and this client's secret key file")
    if server_public:
        sock.curve_serverkey = zmq.auth.load_certificate(server_public)[0]
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(client_secret)
    sock.connect(endpoint)
