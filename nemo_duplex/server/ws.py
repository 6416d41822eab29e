"""A WebSocket as the sessions use it: typed receives with a timeout, sends, a close that never raises, and
`DuplexSocket`, the reader and writer tasks of one connection."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from starlette.websockets import WebSocket, WebSocketDisconnect

log = logging.getLogger("nemo_duplex.server")
GONE = (WebSocketDisconnect, ConnectionError, OSError, RuntimeError)   # what sending to a closed socket raises
# set in a WebSocket's ASGI scope by server/transport.py when its transport was lost without a close frame from
# the client (uvicorn reports that as 1005 or 1006, and a client's own close without a code as 1005 too)
TRANSPORT_LOST = "nemo_duplex.transport_lost"


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
        self.lost = False   # the transport went without a close frame from the client (not a hang-up)
        self.max_bytes = max_bytes

    async def receive(self, timeout: float | None = None) -> Message:
        """The next message (asyncio.TimeoutError after `timeout` seconds without one). Pings and pongs are
        the server's (uvicorn's) business and never reach here, so they do not count as activity."""
        if self.closed:
            return Message("closed")
        try:
            # asyncio.timeout, not wait_for: wait_for (Python 3.11) drops a cancel that comes as the message
            # does, and a connection cut (DuplexSocket.cut) would then keep reading
            async with asyncio.timeout(timeout):
                msg = await self.ws.receive()
        except TimeoutError:   # (an OSError: before GONE)
            raise
        except GONE:
            msg = {"type": "websocket.disconnect", "code": 1006}
        if msg["type"] == "websocket.disconnect":
            self.closed = True
            self.lost = msg.get("code") == 1006 or bool(self.ws.scope.get(TRANSPORT_LOST))
            return Message("closed")
        text = msg.get("text")
        data = (msg.get("bytes") or b"") if text is None else text
        if self.max_bytes is not None and (size := message_bytes(data, self.max_bytes)) > self.max_bytes:
            await self.close(1009, f"message of {size} bytes; the limit is serve.max_message_kb = "
                                   f"{self.max_bytes // 1024}")
            return Message("closed")
        return Message("text" if text is not None else "bytes", data)

    @property
    def transport_lost(self) -> bool:
        """Whether the connection went without a close frame from the client, as the reader saw it or the
        transport marked it (server/transport.py) by now."""
        return self.lost or bool(self.ws.scope.get(TRANSPORT_LOST))

    async def send_text(self, text: str) -> None:
        await self.ws.send_text(text)

    async def send_bytes(self, data: bytes) -> None:
        await self.ws.send_bytes(data)

    async def send(self, data: str | bytes) -> None:
        await (self.send_text(data) if isinstance(data, str) else self.send_bytes(data))

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


class CallConnection:
    """A call's WebSocket side, whatever its dialect (server/realtime.py, server/native.py): it is served by one
    connection at a time, and a new one may take it over after the transport was lost (server/resume.py).
    Every message goes out through `send`, which numbers it in the call's SentLog before the socket sees it.
    Subclasses give `_read(socket)` and `_write(socket)`; the writer sends each outbox item's messages with one
    `send`, so a connection cut between two of them loses none."""

    def __init__(self, bridge):
        self.bridge = bridge
        self.sent = None                 # its SentLog when calls are resumable (server/resume.py sets it)
        self.token: str | None = None    # its resume token, likewise
        self.generation = 0              # which connection may serve the call (claim)
        self.duplex: DuplexSocket | None = None
        self.closing: tuple[int, str] | None = None   # the close the writer began (code, reason)
        self.idle = asyncio.Event()      # no connection is serving the call
        self.idle.set()
        self.last_heard = time.monotonic()   # the client's last message, on any of the call's connections
        self.opened_with: str | None = None  # the client secret that opened it: it resumes the call past its expiry

    async def receive(self, socket: Socket, idle_s: float | None) -> Message:
        """The client's next message on `socket`; TimeoutError once `idle_s` (serve.idle_timeout_s) has passed
        since its last message on any connection of the call: a reconnect does not restart the clock, so a
        client cannot hold its place by dropping and resuming a silent call."""
        timeout = None if idle_s is None else max(0.0, idle_s - (time.monotonic() - self.last_heard))
        msg = await socket.receive(timeout=timeout)
        if msg.kind != "closed":
            self.last_heard = time.monotonic()
        return msg

    def claim(self) -> int:
        """A connection claims the call: the one serving it (if any) is cut and ends without hanging up."""
        self.generation += 1
        if self.duplex is not None:
            self.duplex.cut()
        return self.generation

    async def serve(self, socket: Socket, replay: list | None = None, generation: int | None = None) -> bool:
        """Serve the call over `socket` until it ends, after sending `replay` (the messages a lost connection
        did not deliver). -> whether the transport was lost (the messages sent may not have arrived, so the
        call, or what it last sent, may wait for a new connection). A resuming connection gives the
        `generation` it claimed: if a newer one has claimed the call meanwhile, it serves nothing."""
        if generation is not None and generation != self.generation:
            return False
        self.idle.clear()
        self.duplex = duplex = DuplexSocket(socket)
        self.bridge.attach(duplex.cut)
        try:
            await duplex.run(lambda: self._read(socket), lambda: self._write_after(socket, replay or []))
            return socket.transport_lost
        finally:
            self.bridge.detach()
            self.duplex = None
            self.idle.set()

    async def _write_after(self, socket: Socket, replay: list) -> None:
        for data in replay:
            await socket.send(data)
        if self.closing is not None:   # the call's last messages were among them
            return await self.duplex.close(*self.closing)
        await self._write(socket)

    async def send(self, socket: Socket, *messages: str | bytes) -> None:
        if self.sent is not None:
            for data in messages:
                self.sent.record(data)
        for data in messages:
            await socket.send(data)

    async def finish(self, socket: Socket, code: int, reason: str, *messages: str | bytes) -> None:
        """The call's last messages, then the close. A connection lost on the way may still be resumed: the
        new one gets what this one did not deliver, then the same close."""
        self.closing = (code, reason)
        await self.send(socket, *messages)
        await self.duplex.close(code, reason)

    async def _read(self, socket: Socket) -> None:
        raise NotImplementedError

    async def _write(self, socket: Socket) -> None:
        raise NotImplementedError
