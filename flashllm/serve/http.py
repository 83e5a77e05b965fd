"""The listening socket and uvicorn around the app: a header read timeout, and a graceful stop.

On SIGTERM or Ctrl-C the server stops accepting, lets running generations go on for `grace`
seconds, then ends each with a final chunk (finish_reason length, stop_reason shutdown) and
`data: [DONE]`; requests still queued get a 503.
"""

from __future__ import annotations

import ipaddress
import socket
import threading

from flashllm.errors import FlashLLMError
from flashllm.serve.app import Server, create_app

GRACE = 5.0  # seconds running generations may go on after a stop signal


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, opened before the model loads: a port in use or a bad address is
    a one-line error at once, not uvicorn's log after the load."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except (OSError, OverflowError) as exc:
        raise FlashLLMError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None


def is_loopback(sock: socket.socket) -> bool:
    """The socket listens only on this machine (127.0.0.0/8 or ::1)."""
    return ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_loopback


def uvicorn_server(server: Server, log_level: str = "info", grace: float = GRACE):
    """A uvicorn.Server for `server` whose stop signal drains the scheduler, and whose connections must send a
    request's headers within `server.read_timeout` seconds."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedProtocol(H11Protocol):
        """h11, closing a connection that has not sent a whole request head in time."""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.loop.call_later(server.read_timeout, self.head_timeout)

        def head_timeout(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

    class Graceful(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                threading.Thread(target=server.scheduler.close, args=(grace,), daemon=True).start()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(create_app(server), log_level=log_level, http=TimedProtocol,
                            timeout_graceful_shutdown=grace + 5)
    return Graceful(config)


def run(server: Server, sock: socket.socket, log_level: str = "info", grace: float = GRACE) -> None:
    """Serve on the listening socket until SIGTERM or Ctrl-C (both stop it gracefully)."""
    try:
        uvicorn_server(server, log_level=log_level, grace=grace).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        server.scheduler.close()
