"""A WebSocket as the sessions use it: typed receives with a timeout, sends, a close that never raises, and
`DuplexSocket`, the reader and writer tasks of one connection."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from starlette.websockets import WebSocket, WebSocketDisconnect

log = logging.getLogger("nemo_duplex.server")
GONE = (WebSocketDisconnect, ConnectionError, OSError, RuntimeError)   # what sending to a closed socket raises


@dataclass
class Message:
    kind: str                      # "text" | "bytes" | "closed"
    data: str | bytes | None = None


def message_bytes(data: str | bytes, limit: int) -> int:
    """A message's size on the wire (UTF-8 for text), counted exactly only when it could exceed `limit`."""
    if isinstance(data, bytes) or len(data) * 4 <= limit:   # (a character is at most 4 bytes)
        return len(data)
    return len(data.encode("utf-8", "surrogatepass"))


class Socket:
    """An accepted Starlette WebSocket. A message over `max_bytes` closes it with 1009: uvicorn enforces the
    same limit in one process, but behind Ray Serve's proxy (serve.replicas > 1) only this check does."""

    def __init__(self, websocket: WebSocket, max_bytes: int | None = None):
        self.ws = websocket
        self.closed = False
        self.max_bytes = max_bytes

    async def receive(self, timeout: float | None = None) -> Message:
        """The next message (asyncio.TimeoutError after `timeout` seconds without one). Pings and pongs are
        the server's (uvicorn's) business and never reach here, so they do not count as activity."""
        if self.closed:
            return Message("closed")
        try:
            msg = await (asyncio.wait_for(self.ws.receive(), timeout) if timeout else self.ws.receive())
        except TimeoutError:   # (an OSError: before GONE)
            raise
        except GONE:
            msg = {"type": "websocket.disconnect"}
        if msg["type"] == "websocket.disconnect":
            self.closed = True
            return Message("closed")
        text = msg.get("text")
        data = (msg.get("bytes") or b"") if text is None else text
        if self.max_bytes is not None and (size := message_bytes(data, self.max_bytes)) > self.max_bytes:
            await self.close(1009, f"message of {size} bytes; the limit is serve.max_message_kb = "
                                   f"{self.max_bytes // 1024}")
            return Message("closed")
        return Message("text" if text is not None else "bytes", data)

    async def send_text(self, text: str) -> None:
        await self.ws.send_text(text)

    async def send_bytes(self, data: bytes) -> None:
        await self.ws.send_bytes(data)

    async def close(self, code: int, reason: str = "") -> None:
        try:
            await self.ws.close(code=code, reason=reason[:120])   # a close reason holds at most 123 bytes
        except GONE:
            pass
        self.closed = True


class DuplexSocket:
    """One WebSocket served by two tasks: a reader (client messages) and a writer (engine output), the writer
    being the one that ends the socket. The reader ending first (the client closed or vanished) cancels the
    writer, which may be waiting for output; the writer closing the socket stops the reader first. `cut`
    (a connection stuck behind a client that does not read) cancels both."""

    def __init__(self, socket: Socket):
        self.socket = socket
        self.reader: asyncio.Task | None = None
        self.writer: asyncio.Task | None = None
        self.closing = False

    async def run(self, read, write) -> None:
        """Until both tasks end. A bug in either is logged once and ends this connection, not the server."""
        self.reader = asyncio.create_task(read())
        self.writer = asyncio.create_task(write())
        tasks = {self.reader, self.writer}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if self.reader in done and not self.closing:
                self.writer.cancel()      # the client is gone: nobody to write to
            elif self.writer in done:
                self.reader.cancel()      # the writer ended the connection (or failed)
            await asyncio.wait(tasks)
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            for t in tasks:
                try:
                    await t
                except (asyncio.CancelledError, *GONE):
                    pass
                except Exception:   # noqa: BLE001 - a bug in one connection's task
                    log.exception("a connection's %s failed", "reader" if t is self.reader else "writer")

    async def close(self, code: int, reason: str = "") -> None:
        """(From the writer) stop the reader, then close the socket."""
        self.closing = True
        if self.reader is not None and not self.reader.done():
            self.reader.cancel()
        await self.socket.close(code, reason)

    def cut(self) -> None:
        for t in (self.reader, self.writer):
            if t is not None and not t.done():
                t.cancel()
