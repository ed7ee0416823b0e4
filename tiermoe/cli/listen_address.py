"""Whether the server can listen where it is told to, checked before the model loads (which can take minutes):
a --host that does not resolve, or a port another process holds, then fails at once with one line."""

from __future__ import annotations

import errno
import socket

from tiermoe.errors import TiermoeError


def check_listen_address(host: str, port: int) -> None:
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        raise TiermoeError(f"--host '{host}' does not resolve to an address of this machine ({err}); expected an "
                           "IP address or a host name, e.g. 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, address = addresses[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing socket is fine
        try:
            probe.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise TiermoeError(f"port {port} on {host} is in use by another process; choose another --port") \
                    from None
            raise TiermoeError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
