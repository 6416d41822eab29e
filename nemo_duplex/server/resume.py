"""A call outlives a dropped connection: the messages it sent, numbered, and the calls waiting for their client
to reconnect (`serve.resume_grace_s`; docs/protocol.md, "Reconnecting a lost connection").

A WebSocket whose transport is lost without a close frame (a network change, a proxy's reset, a keepalive
timeout) does not hang up its call: the call is parked with its place, its settings and its queued output, and a
new connection that presents the call's resume token and the number of messages it received takes it over.
Every message a call sends (text or binary) is counted from 1 and the newest `serve.resume_buffer_kb` of them
are kept, so the new connection gets exactly the messages the old one lost, then the rest of the call. A call
not taken back within the grace ends as a hang-up. A close frame from the client, of any code, is a hang-up."""
from __future__ import annotations

import asyncio
import secrets
from collections import deque

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from nemo_duplex.runtime import SettingsError
from nemo_duplex.server.access import Access
from nemo_duplex.server.errors import Refusal
from nemo_duplex.server.ws import GONE, CallConnection, Socket


class SentLog:
    """The wire messages of one call, numbered from 1 in the order they were handed to the socket; the newest
    kept while their size is within `max_bytes` (the newest one always)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.sent = 0                   # messages recorded so far = the number of the newest
        self._kept: deque = deque()     # the newest messages, oldest first
        self._bytes = 0

    def record(self, data: str | bytes) -> None:
        self.sent += 1
        self._kept.append(data)
        self._bytes += len(data)
        while len(self._kept) > 1 and self._bytes > self.max_bytes:
            self._bytes -= len(self._kept.popleft())

    @property
    def first_kept(self) -> int:
        """The number of the oldest message still kept (sent + 1 when none is)."""
        return self.sent - len(self._kept) + 1

    def after(self, received: int) -> list[str | bytes]:
        """The messages after the first `received`, or a Refusal naming what cannot be given back."""
        if received > self.sent:
            raise Refusal("invalid_resume", f"received={received}, but this call has sent {self.sent} messages", 400)
        if received + 1 < self.first_kept:
            raise Refusal("resume_gap", f"messages {received + 1} to {self.first_kept - 1} are no longer kept "
                          f"(serve.resume_buffer_kb = {self.max_bytes // 1024}); the call cannot be resumed", 409)
        return list(self._kept)[received + 1 - self.first_kept:]


class Parking:
    """The resumable calls by token: those with a connection, those parked (no connection; the call goes on
    and ends as a hang-up, `expire(session)`, unless a new connection takes it within the grace), and those
    lingering (the call is over, but its end went out on a connection that was lost: a new connection may still
    take what it missed within the grace)."""

    def __init__(self, grace_s: float, expire):
        self.grace_s, self._expire = grace_s, expire
        self.live: dict[str, object] = {}                     # token -> session
        self._parked: dict[str, asyncio.TimerHandle] = {}
        self._lingering: dict[str, asyncio.TimerHandle] = {}

    @staticmethod
    def new_token(route: str = "") -> str:
        """A call's resume token: `route` (the replica that holds the call, by which Serve's proxy routes the
        resume: server/replicas.py), a dot, 32 random characters; only the random part without a route."""
        return f"{route}.{secrets.token_urlsafe(24)}" if route else secrets.token_urlsafe(24)

    def register(self, token: str, session) -> None:
        self.live[token] = session

    def unregister(self, token: str) -> None:
        self.live.pop(token, None)
        self.unpark(token)

    def park(self, token: str) -> None:
        """The call of `token` has no connection: it ends unless one takes it within the grace."""
        if token not in self._parked:
            session = self.live[token]
            self._parked[token] = asyncio.get_running_loop().call_later(self.grace_s, self._ran_out, token, session)

    def linger(self, token: str) -> None:
        self.unpark(token)
        self._lingering[token] = asyncio.get_running_loop().call_later(self.grace_s, self.unregister, token)

    @property
    def parked(self) -> int:
        return len(self._parked)

    def take(self, token: str | None):
        """The session of `token` for a new connection (parked, lingering, or still held by a connection the server
        has not yet found dead), or a Refusal. Its grace runs on until `unpark`."""
        session = self.live.get(token) if token else None
        if session is None:
            raise Refusal("unknown_resume_token", "no call to resume with this token: it never existed, the call "
                          f"has ended, or it was not resumed within serve.resume_grace_s = {self.grace_s:g} s", 404)
        return session

    def unpark(self, token: str) -> None:
        """A new connection serves the call of `token` from now on (or it is gone)."""
        for timers in (self._parked, self._lingering):
            if (timer := timers.pop(token, None)) is not None:
                timer.cancel()

    def _ran_out(self, token: str, session) -> None:
        self._parked.pop(token, None)
        if self.live.get(token) is session:
            del self.live[token]
            self._expire(session)

    def expire_all(self) -> None:
        """Shutdown: every parked call ends now, and no lingering one can be taken."""
        for token in list(self._lingering):
            self.unregister(token)
        for token in list(self._parked):
            self._parked.pop(token).cancel()
            self._expire(self.live.pop(token))


class CallConnections:
    """The connections of each WebSocket call of one server (server/app.py): the first, what happens when it
    ends (the call ends, or waits for its client when the transport was lost), and those resuming a call."""

    def __init__(self, server):
        self.server, cfg = server, server.cfg
        if cfg.resume_grace_s < 0 or cfg.resume_buffer_kb < 1:
            raise SettingsError(f"serve.resume_grace_s = {cfg.resume_grace_s:g} (>= 0; 0 = off) and "
                                f"serve.resume_buffer_kb = {cfg.resume_buffer_kb} (>= 1)")
        self.grace_s, self.buffer_bytes = cfg.resume_grace_s, cfg.resume_buffer_kb * 1024
        self.max_message_bytes = cfg.max_message_kb * 1024
        self.metrics = server.metrics
        self.parking = Parking(self.grace_s, self._expired)
        self.route = ""   # behind Serve's proxy, this replica's id: the head of every resume token (new_token)

    def resumable(self, session: CallConnection) -> CallConnection:
        """Give `session` a SentLog and a resume token when calls are resumable (serve.resume_grace_s > 0)."""
        if self.grace_s > 0:
            session.sent = SentLog(self.buffer_bytes)
            session.token = Parking.new_token(self.route)
            self.parking.register(session.token, session)
        return session

    async def serve(self, session: CallConnection, connection) -> None:
        """Until `connection` (a coroutine serving the call; True if its transport was lost) ends: then the call
        waits for its client to resume it, ends, or, taken over by a newer connection, is left to that one."""
        generation = session.generation
        lost = False
        try:
            lost = await connection
        finally:
            if session.generation == generation:
                resumable = lost and session.token is not None and not self.server.stopping
                if resumable and session.closing is None and session.bridge.failed is None:
                    self.parking.park(session.token)        # the call goes on, waiting for its client
                else:
                    self.end(session, keep_token=resumable and session.closing is not None)

    def end(self, session: CallConnection, message: str = "the client disconnected", keep_token: bool = False) -> None:
        """The call's connection is over: the call ends (if the engine has not ended it) and its place is given
        back. keep_token: the call's last messages went out on a lost connection, so its client may still come
        back for them within the grace (Parking.linger)."""
        if session.token is not None:
            (self.parking.linger if keep_token else self.parking.unregister)(session.token)
        session.bridge.hang_up(message)

    def _expired(self, session: CallConnection) -> None:
        self.metrics.resumes.labels("expired").inc()
        session.bridge.hang_up(f"the connection was lost and not resumed within serve.resume_grace_s = "
                               f"{self.grace_s:g} s")

    async def resume(self, websocket: WebSocket, kind: type, other_route: str, secret_ok: bool = False) -> None:
        """`?resume=<token>&received=<n>`: the call of `token` (parked, or still held by a connection the server
        has not yet found dead, which is cut) continues on this connection, from message n + 1. Refused before
        the upgrade: 401 / 403 (access; secret_ok: a live client secret stands for a key), 404 unknown_resume_token,
        400 invalid_resume, 409 resume_gap."""
        token = websocket.query_params.get("resume")
        held = self.parking.live.get(token) if token else None   # (its opening secret resumes it, expired too)
        also = held.opened_with if held is not None else None
        if (refused := self.server.refused(websocket.headers, "ws", secret_ok, also)) is not None:
            return await websocket.send_denial_response(refused)
        received = websocket.query_params.get("received", "")
        try:
            if self.server.stopping:
                raise Refusal("server_shutdown", "the server is shutting down", 503)
            if not (received.isascii() and received.isdigit()) or len(received) > 12:
                raise Refusal("invalid_resume", f"received={received[:20]!r}: the number of messages this call's "
                              "previous connection received (an integer >= 0) must come with resume", 400)
            session = self.parking.take(token)
            if not isinstance(session, kind):
                raise Refusal("unknown_resume_token", f"this token's call is not a {kind.__name__} call: resume it "
                              f"on {other_route}", 404)
            session.sent.after(int(received))        # what cannot be given back is refused before the upgrade
            generation = session.claim()             # a connection still serving the call is cut
            await session.idle.wait()
            if session.generation != generation or self.parking.live.get(token) is not session:
                raise Refusal("unknown_resume_token", "the call was taken over by a newer connection, or ended", 404)
            try:
                replay = session.sent.after(int(received))   # (the cut connection may have sent more meanwhile)
            except Refusal:
                self.parking.park(token)   # the call has no connection now: its grace runs
                raise
        except Refusal as r:
            self.metrics.refusal(r.code)
            return await websocket.send_denial_response(JSONResponse(
                {"type": "error", "code": r.code, "message": r.message}, status_code=r.status))
        self.parking.unpark(token)
        self.metrics.resumes.labels("resumed").inc()
        await self.serve(session, self._accept(websocket, session, replay, generation))

    async def _accept(self, websocket: WebSocket, session: CallConnection, replay: list, generation: int) -> bool:
        try:
            await websocket.accept(subprotocol=Access.subprotocol(websocket.headers))
        except GONE:   # lost again before the upgrade completed: the call waits on
            return True
        # (a resume that arrived during this upgrade has claimed the call since: then this one serves nothing)
        return await session.serve(Socket(websocket, self.max_message_bytes), replay, generation)
