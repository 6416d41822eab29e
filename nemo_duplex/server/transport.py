"""uvicorn's HTTP and WebSocket protocols (server/app.py `uvicorn_config`) with two changes: a TCP half-close is
not a hang-up, and connections reset before their request or upgrade completed are counted in /metrics
(`duplex_connection_resets{stage}`) and logged in one line each, instead of a traceback. Behind Ray Serve
(serve.replicas > 1) the proxy's own uvicorn serves the connections: server/replicas.py gives it the WebSocket
protocol (a lost transport marked, so that its call may be resumed), not the HTTP one."""
from __future__ import annotations

import logging

log = logging.getLogger("nemo_duplex.server")


def reset(metrics, stage: str, client) -> None:
    if metrics is not None:   # (None in Serve's proxy, server/replicas.py: its resets are only logged)
        metrics.connection_resets.labels(stage).inc()
    where = f"{client[0]}:{client[1]}" if client else "a client"
    log.info("connection from %s reset before its %s was complete (duplex_connection_resets)", where, stage)


def http_protocol(metrics):
    """uvicorn's HTTP protocol (httptools when installed, else h11, as its "auto" picks), which

    - keeps the connection open when the client shuts only its sending side (TCP half-close) while its
      request is being answered: a client that sent its whole upload and half-closed still gets the rest of
      its NDJSON reply (uvicorn would close at once, cutting the call). A client that really hung up is
      found by the next write (a reset), one frame later;
    - counts a connection reset before any request on it was complete (stage "request")."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class HTTPProtocol(Base):
        half_closed = False

        def eof_received(self):
            if self.cycle is None or self.cycle.response_complete:
                return None   # nothing in flight: close as uvicorn does
            self.half_closed = True
            return True       # keep the transport open for the reply

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.half_closed:
                self.transport.close()

        def connection_lost(self, exc) -> None:
            if exc is not None and self.cycle is None:
                reset(metrics, "request", getattr(self, "client", None))
            super().connection_lost(exc)

    return HTTPProtocol


def websocket_protocol(metrics):
    """uvicorn's sans-I/O websockets protocol, which

    - counts a connection reset after the upgrade request but before the server accepted it (stage "upgrade");
    - marks a connection whose transport went without a close frame from the client (a reset, a network
      change, a keepalive timeout), and not after a close of the server's own, in its scope (ws.TRANSPORT_LOST):
      its call may be resumed (server/resume.py). uvicorn reports such a loss as 1005, the code of a client's
      close frame without one."""
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    from nemo_duplex.server.ws import TRANSPORT_LOST

    KEEPALIVE_TIMEOUT = "keepalive ping timeout"   # the reason of uvicorn's close when its pings go unanswered

    class WebSocketProtocol(WebSocketsSansIOProtocol):
        def connection_lost(self, exc) -> None:
            if not self.handshake_complete:
                reset(metrics, "upgrade", getattr(self, "client", None))
            elif self.conn.close_rcvd is None and getattr(self, "scope", None) is not None and (
                    self.conn.close_sent is None or self.conn.close_sent.reason == KEEPALIVE_TIMEOUT):
                # (a close of the server's own, such as 1009 for a message too big, ended it on purpose)
                self.scope[TRANSPORT_LOST] = True
            super().connection_lost(exc)

    return WebSocketProtocol
