"""The server: many callers at once on one engine, with hard limits and clear refusals. An ASGI app
(Starlette), served by uvicorn (`serve`), or by Ray Serve replicas.

Routes (docs/protocol.md has the wire formats and every error code):
  WS   /v1/realtime   OpenAI Realtime (GA names; beta spellings accepted on input): server/realtime.py
  WS   /generate/ws   the native protocol: JSON opening message, binary PCM both ways, JSON events: server/native.py
  POST /generate      upload a WAV, get the same events and audio back as NDJSON while they are produced
  GET  /health        200 once warm-up is done and the engine thread is alive, else 503
  GET  /metrics       Prometheus text
  GET  /              the browser page (static/index.html)

Places: a connection reserves one of `engine.max_calls` places when it arrives (refused with `busy` when
none is free, never queued) and gives it back only once the engine has ended its call, so the server
never promises a slot the engine does not have. The engine steps on its own thread; this event loop only
moves bytes (server/bridge.py, server/handover.py).
One file past 500 lines on purpose: every route and the places' accounting that each of them goes through.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import signal
import sys
import threading
import traceback
import uuid
from pathlib import Path

import numpy as np
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from nemo_duplex.audio import AudioFormatError, decode_wav, wav_info
from nemo_duplex.server.access import Access
from nemo_duplex.server.bridge import CallBridge, call_options
from nemo_duplex.server.client_secrets import ClientSecrets, expiry_seconds
from nemo_duplex.server.context import ServerContext
from nemo_duplex.server.errors import Refusal
from nemo_duplex.server.metrics import ServerMetrics
from nemo_duplex.server.native import NativeSession, native_opening, read_body, read_upload
from nemo_duplex.server.realtime import RealtimeSession, check_settings, session_update
from nemo_duplex.server.realtime_protocol import (
    ProtocolError,
    SessionSettings,
    error_event,
    parse_client_event,
    session_object,
)
from nemo_duplex.server.resume import CallConnections
from nemo_duplex.server.ws import Socket
from nemo_duplex.serving.calls import CallOptions, EndedEvent
from nemo_duplex.settings import ServeConfig

STATIC = Path(__file__).resolve().parent / "static"
log = logging.getLogger("nemo_duplex.server")
CLIENT_SECRET_BODY_KB = 64   # a mint request: its session settings (instructions, tools) and expiry
CALL_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")   # a client's own call id: it is echoed in headers and events
COUNTED_BY_RESERVE = ("busy", "call_id_in_use", "not_ready", "invalid_call_id", "server_shutdown")


class Server:
    def __init__(self, engine, tokenizer, rnnt_vocab, cfg: ServeConfig | None = None, model_name: str = "",
                 voices: list[str] | None = None, default_voice: str | None = None,
                 session_defaults: SessionSettings | None = None):
        self.engine = engine
        self.cfg = cfg or ServeConfig()
        mc = engine.model.cfg
        self.metrics = ServerMetrics(self.cfg.deadline_ms / 1000.0)
        # what every session and call sees of the server; session_defaults: what a call gets for the settings
        # its session does not give (scripts/serve.py's `seed` and `sampling`)
        self.ctx = ServerContext(engine, tokenizer, rnnt_vocab, self.cfg, self.metrics, model_name or mc.name,
                                 voices or [mc.talker.speaker], default_voice or mc.talker.speaker,
                                 session_defaults or SessionSettings(), forget=self.forget)
        self.access = Access.from_config(self.cfg)
        self.client_secrets = ClientSecrets(self.cfg.max_client_secrets)   # keys a browser may hold (Realtime only)
        # each WebSocket call's connections: the first, losing it, and those resuming the call (server/resume.py)
        self.call_connections = CallConnections(self)
        self.connections = 0   # open call connections, with or without a place (serve.max_connections)
        self.max_connections = (self.cfg.max_connections if self.cfg.max_connections is not None
                                else engine.cfg.max_calls + 16)
        self.sessions: dict[str, CallBridge] = {}
        self.ready = False
        self.stopping = False   # SIGTERM received: no new call (drain)
        self._tasks: list[asyncio.Task] = []
        # set by a Ray Serve replica (server/replicas.py): /health and /metrics then speak for every replica
        self.cluster = None
        self._stalls_reported: set[str] = set()   # (_report_stalls)

    @property
    def model_name(self) -> str:
        return self.ctx.model_name

    @property
    def max_calls(self) -> int:
        return self.ctx.max_calls

    @property
    def max_call_s(self) -> float:
        return self.ctx.max_call_s

    # -- places
    def reserve(self, call_id: str | None) -> CallBridge:
        if call_id and not CALL_ID.fullmatch(call_id):   # (an empty one is none: the server makes one)
            self.metrics.refusal("invalid_call_id")
            raise Refusal("invalid_call_id", f"call_id of {len(call_id)} characters: 1 to 64 of A-Z a-z 0-9 . _ : -",
                          400)
        call_id = call_id or uuid.uuid4().hex[:16]
        if call_id in self.sessions:
            self.metrics.refusal("call_id_in_use")
            raise Refusal("call_id_in_use", f"call id {call_id!r} belongs to a live call", 409)
        if self.stopping:
            self.metrics.refusal("server_shutdown")
            raise Refusal("server_shutdown", "the server is shutting down", 503)
        if not self.ready:
            self.metrics.refusal("not_ready")
            raise Refusal("not_ready", "the server is still warming up; see GET /health", 503)
        if len(self.sessions) >= self.max_calls:
            self.metrics.refusal("busy")
            raise Refusal("busy", f"all {self.max_calls} call places are taken (engine.max_calls); "
                          f"try again later", 503)
        bridge = CallBridge(self.ctx, call_id)
        self.sessions[call_id] = bridge
        return bridge

    def forget(self, bridge: CallBridge) -> None:
        if self.sessions.get(bridge.id) is bridge:
            del self.sessions[bridge.id]

    # -- lifecycle
    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        # capture and warm-up run in the background: the port answers at once, /health says 503 until done
        self._tasks = [asyncio.create_task(self._start_engine()), asyncio.create_task(self._sample_metrics())]
        try:
            yield
        finally:
            for task in self._tasks:
                task.cancel()
            self.ready = False
            await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)

    async def drain(self) -> None:
        """Stopping (SIGTERM): no new call; the live ones get serve.shutdown_grace_s to end on their own (an
        upload or an ended input drains), then each still live is ended with `server_shutdown` and its socket
        closed; returns once every place is free (or 5 s after the cut)."""
        self.stopping, self.ready = True, False
        self.metrics.ready.set(0)
        self.call_connections.parking.expire_all()   # no client may come back to a stopping server
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.shutdown_grace_s
        while self.sessions and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.sessions:
            log.warning("shutting down: %d calls still live after serve.shutdown_grace_s = %g s are cut",
                        len(self.sessions), self.cfg.shutdown_grace_s)
        for bridge in list(self.sessions.values()):
            bridge.fail("server_shutdown", f"the server is shutting down (serve.shutdown_grace_s = "
                        f"{self.cfg.shutdown_grace_s:g} s passed)")
        deadline = loop.time() + 5.0
        while self.sessions and loop.time() < deadline:
            await asyncio.sleep(0.05)

    async def _start_engine(self) -> None:
        try:
            if not self.engine.alive:   # graph capture happens here: on a worker thread, not on the loop
                await asyncio.get_running_loop().run_in_executor(None, self.engine.start)
            await self.warm_up()
        except Exception:
            log.exception("engine start-up failed; /health stays 503")
            raise

    async def warm_up(self) -> None:
        """Run serve.warmup_frames silent frames through a throwaway call (first-step allocations, graph
        capture when engine.graphs is on) before declaring ready."""
        if self.cfg.warmup_frames > 0:
            loop = asyncio.get_running_loop()
            done = loop.create_future()

            def on_event(ev):
                if isinstance(ev, EndedEvent):
                    loop.call_soon_threadsafe(lambda: done.done() or done.set_result(ev))

            call = self.engine.open_call(CallOptions(), on_event, "warmup")
            call.append(np.zeros(self.cfg.warmup_frames * self.ctx.frame_in, dtype=np.float32))
            call.end_input()
            ev = await done
            if ev.reason != "completed":
                raise RuntimeError(f"warm-up call ended with {ev.reason}: {ev.message}")
        # Everything alive now (the model's modules and parameters, the captured graphs' bookkeeping) lives as
        # long as the server: moved out of the cyclic GC's reach, a full collection while serving scans only
        # what calls create (one step's event hand-over once stalled 41 ms under 128 calls; sglang freezes
        # after its graph capture for the same reason).
        gc.collect()
        gc.freeze()
        self.ready = True
        self.metrics.ready.set(1)

    async def _sample_metrics(self) -> None:
        while True:
            self.metrics.sample_engine(self.engine, len(self.sessions))
            self.metrics.parked_calls.set(self.call_connections.parking.parked)
            self._report_stalls()
            if self.cluster is not None:   # a Ray Serve replica: what the deployment's /health and /metrics show
                await self.cluster.report(self)
            await asyncio.sleep(1.0)

    def _report_stalls(self) -> None:
        """Once per stall (Server.stalls): an error in the log with every thread's Python stack, so that a
        wedged step or admission shows where its thread waits without attaching a debugger."""
        stalls = self.stalls()
        for name in stalls.keys() - self._stalls_reported:
            frames = sys._current_frames()
            stacks = "".join(f"\nthread {t.name}:\n" + "".join(traceback.format_stack(frames[t.ident]))
                             for t in threading.enumerate() if t.ident in frames)
            log.error("%s: under way %.0f s; the threads' stacks:%s", name, stalls[name], stacks)
        self._stalls_reported = set(stalls)

    def stalls(self) -> dict[str, float]:
        """What the engine has had under way too long, by /health's name for it: seconds. A step or an
        admission that never finishes (a wedged GPU, a hung thread) serves no one, so a balancer should send
        calls elsewhere and an orchestrator restart the server (engine.max_step_s, engine.max_admission_s)."""
        stalls = {"engine_stalled": self.engine.engine_stalled_s, "admission_stalled": self.engine.admission_stalled_s}
        return {name: seconds for name, seconds in stalls.items() if seconds}

    def healthy(self) -> bool:
        return self.ready and getattr(self.engine, "ready", True) and self.engine.alive and not self.stalls()

    # -- routes
    def app(self) -> Starlette:
        static = Path(self.cfg.static_dir) if self.cfg.static_dir else STATIC

        async def index(request: Request) -> FileResponse:
            return FileResponse(static / "index.html")

        return Starlette(routes=[
            WebSocketRoute("/v1/realtime", self.realtime),
            WebSocketRoute("/generate/ws", self.generate_ws),
            Route("/generate", self.generate_post, methods=["POST"]),
            Route("/v1/realtime/client_secrets", self.mint_client_secret, methods=["POST"]),
            Route("/health", self.health),
            Route("/metrics", self.prometheus),
            Route("/", index),
            Mount("/static", StaticFiles(directory=static)),
        ], lifespan=self.lifespan, middleware=[Middleware(ConnectionLimit, server=self)] + ([
            # CORS only for the origins named (off by default: a browser page elsewhere cannot read replies)
            Middleware(CORSMiddleware, allow_origins=list(self.cfg.cors_origins), allow_methods=["GET", "POST"],
                       allow_headers=["Authorization", "Content-Type"], expose_headers=["X-Call-Id"]),
        ] if self.cfg.cors_origins else []))

    async def health(self, request: Request) -> JSONResponse:
        if self.cluster is not None:
            body, status = await self.cluster.health()
            return JSONResponse(body, status_code=status)
        ok, stalls = self.healthy(), self.stalls()
        status = "ready" if ok else "starting" if not self.ready else next(iter(stalls), "engine_down")
        body = {"status": status, "active_calls": self.engine.active_calls, "sessions": len(self.sessions),
                "max_calls": self.max_calls, **{f"{name}_s": round(seconds, 1) for name, seconds in stalls.items()}}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prometheus(self, request: Request) -> Response:
        if (refused := self.refused(request.headers, "http")) is not None:
            return refused
        if self.cluster is not None:
            text = await self.cluster.metrics()
        else:
            self.metrics.sample_engine(self.engine, len(self.sessions))
            text = self.metrics.render()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _refuse_ws(self, socket: Socket, refusal: Refusal, realtime: bool) -> None:
        if refusal.code not in COUNTED_BY_RESERVE:
            self.metrics.refusal(refusal.code)
        body = (error_event(f"event_refused_{uuid.uuid4().hex[:8]}", refusal.code, refusal.message) if realtime
                else {"type": "error", "code": refusal.code, "message": refusal.message, "status": refusal.status})
        try:
            await socket.send_text(json.dumps(body))
        except ConnectionError:
            pass
        await socket.close(1013 if refusal.code == "busy" else 1008, refusal.code)

    def refused(self, headers, scheme: str, secret_ok: bool = False, also: str | None = None) -> JSONResponse | None:
        """A request without a valid key or from a foreign origin (server/access.py): its plain JSON refusal.
        secret_ok: a live client secret stands for a key (a Realtime call); also: one more good key."""
        r = self.access.refusal(headers, scheme, self.client_secrets if secret_ok else None, also)
        if r is None:
            return None
        self.metrics.refusal(r.code)
        return JSONResponse({"type": "error", "code": r.code, "message": r.message}, status_code=r.status)

    async def _open(self, websocket: WebSocket, call_id: str | None, in_use_body: dict, secret_ok: bool = False) -> bool:
        """Accept the upgrade, or refuse it with a plain HTTP response (401 / 403 / 409) and return False."""
        if (refused := self.refused(websocket.headers, "ws", secret_ok)) is not None:
            await websocket.send_denial_response(refused)
            return False
        if await self._call_id_in_use(websocket, call_id, in_use_body):
            return False
        await websocket.accept(subprotocol=Access.subprotocol(websocket.headers))
        return True

    async def _call_id_in_use(self, websocket: WebSocket, call_id: str | None, body: dict) -> bool:
        """A `?call_id=` that belongs to a live call: refused before the upgrade, with a plain 409."""
        if not call_id or call_id not in self.sessions:
            return False
        self.metrics.refusal("call_id_in_use")
        await websocket.send_denial_response(JSONResponse(body, status_code=409))
        return True

    # -- WS /v1/realtime
    async def realtime(self, websocket: WebSocket) -> None:
        if "resume" in websocket.query_params:
            return await self.call_connections.resume(websocket, RealtimeSession, other_route="/generate/ws",
                                                      secret_ok=True)
        call_id = websocket.query_params.get("call_id")
        if not await self._open(websocket, call_id, {"error": {
                "type": "invalid_request_error", "code": "call_id_in_use",
                "message": f"call id {call_id!r} belongs to a live call"}}, secret_ok=True):
            return
        secret = self.client_secrets.get(Access.key(websocket.headers))   # its session: where the call starts
        socket = Socket(websocket, self.cfg.max_message_kb * 1024)
        try:
            bridge = self.reserve(call_id)
        except Refusal as r:
            return await self._refuse_ws(socket, r, realtime=True)
        session = self.call_connections.resumable(RealtimeSession(self.ctx, bridge,
                                                                  secret.settings if secret is not None else None))
        session.opened_with = secret.value if secret is not None else None
        await self.call_connections.serve(session, session.run(socket))

    # -- WS /generate/ws (native)
    async def generate_ws(self, websocket: WebSocket) -> None:
        if "resume" in websocket.query_params:
            return await self.call_connections.resume(websocket, NativeSession, other_route="/v1/realtime")
        call_id = websocket.query_params.get("call_id")
        if not await self._open(websocket, call_id, {"type": "error", "code": "call_id_in_use",
                                                     "message": f"call id {call_id!r} belongs to a live call"}):
            return
        socket = Socket(websocket, self.cfg.max_message_kb * 1024)
        try:
            first = await socket.receive(timeout=self.cfg.idle_timeout_s)
        except asyncio.TimeoutError:
            return await self._refuse_ws(socket, Refusal("idle_timeout", "no opening message within serve."
                                                         f"idle_timeout_s = {self.cfg.idle_timeout_s:g} s"), False)
        if first.kind == "closed":
            return
        if first.kind != "text":
            return await self._refuse_ws(socket, Refusal("invalid_event", "the first message must be the JSON "
                                                         "opening message"), False)
        try:
            opening = parse_client_event(first.data)
            settings, voice, call_id = native_opening(self.ctx, opening, call_id)
            bridge = self.reserve(call_id)
        except ProtocolError as e:
            return await self._refuse_ws(socket, Refusal(e.code, e.message), False)
        except Refusal as r:
            return await self._refuse_ws(socket, r, False)
        try:
            bridge.open(call_options(settings, voice), settings.input_format)
        except Refusal as r:
            bridge.hang_up()
            return await self._refuse_ws(socket, r, False)
        session = self.call_connections.resumable(NativeSession(self.ctx, bridge, settings,
                                                              tokens=opening.get("tokens") is True))
        await self.call_connections.serve(session, session.run_ws(socket))

    # -- POST /v1/realtime/client_secrets
    async def mint_client_secret(self, request: Request) -> Response:
        """A key for a browser, minted with a real one (server/client_secrets.py)."""
        if (refused := self.refused(request.headers, "http")) is not None:
            return refused
        try:
            raw = await read_body(request, CLIENT_SECRET_BODY_KB * 1024)
            try:
                body = json.loads(raw or b"{}")
            except ValueError as e:   # (UnicodeDecodeError too)
                raise ProtocolError("invalid_event", f"the body is not JSON: {e}"[:200]) from None
            if not isinstance(body, dict):
                raise ProtocolError("invalid_event", "the body must be a JSON object")
            seconds = expiry_seconds(body.get("expires_after"))
            session = body.get("session")
            if isinstance(session, dict) and session.get("type", "realtime") != "realtime":
                raise ProtocolError("not_supported", f"session.type {str(session['type'])[:40]!r}: only 'realtime' "
                                    "sessions exist here", "session.type")
            settings = self.ctx.session_defaults
            if session is not None:
                settings = session_update(self.ctx, session, settings)
                check_settings(self.ctx, settings)
            secret = self.client_secrets.mint(settings, seconds)
        except ProtocolError as e:
            code, message, param, status = e.code, e.message, e.param, 400
        except Refusal as r:
            code, message, param, status = r.code, r.message, None, r.status
        else:
            body = session_object(f"sess_{uuid.uuid4().hex[:16]}", self.ctx.model_name, secret.settings,
                                  secret.settings.voice or self.ctx.default_voice, self.ctx.capabilities())
            return JSONResponse({"value": secret.value, "expires_at": int(secret.expires_at), "session": body})
        self.metrics.refusal(code)
        return JSONResponse({"type": "error", "code": code, "message": message, "param": param}, status_code=status)

    # -- POST /generate
    async def generate_post(self, request: Request) -> Response:
        if (refused := self.refused(request.headers, "http")) is not None:
            return refused
        try:
            fields, wav = await read_upload(request, self.cfg.max_upload_mb)
            given = [k for k in ("sample_rate", "channels", "format", "sample_width") if k in fields]
            if given:
                raise ProtocolError("invalid_event", f"{', '.join(given)}: an upload's audio format is its WAV "
                                    "header's (any rate, channel count and integer width is taken)", given[0])
            opening = {"type": "start", **fields}
            settings, voice, call_id = native_opening(self.ctx, opening, request.query_params.get("call_id"))
            info = wav_info(wav)
            if info.seconds > self.cfg.max_upload_s:
                raise Refusal("upload_too_long", f"{info.seconds:.1f} s of audio; the limit is "
                              f"serve.max_upload_s = {self.cfg.max_upload_s:g} s", 413)
            if info.seconds > self.max_call_s:
                raise Refusal("call_too_long", f"{info.seconds:.1f} s of audio; the limit is "
                              f"engine.max_call_s = {self.max_call_s:g} s", 413)
            if settings.max_call_s is not None and info.seconds > settings.max_call_s:
                raise Refusal("call_too_long", f"{info.seconds:.1f} s of audio; the limit is the upload's own "
                              f"max_call_s = {settings.max_call_s:g} s", 413)
            pcm = decode_wav(wav, self.ctx.in_rate)
            bridge = self.reserve(call_id)
        except AudioFormatError as e:
            self.metrics.refusal("invalid_audio_format")
            return JSONResponse({"type": "error", "code": "invalid_audio_format", "message": str(e)}, status_code=400)
        except ProtocolError as e:
            self.metrics.refusal(e.code)
            return JSONResponse({"type": "error", "code": e.code, "message": e.message, "param": e.param},
                                status_code=400)
        except Refusal as r:
            if r.code not in COUNTED_BY_RESERVE:
                self.metrics.refusal(r.code)
            return JSONResponse({"type": "error", "code": r.code, "message": r.message}, status_code=r.status)
        try:
            bridge.open(call_options(settings, voice))
        except Refusal as r:
            bridge.hang_up()
            return JSONResponse({"type": "error", "code": r.code, "message": r.message}, status_code=r.status)
        session = NativeSession(self.ctx, bridge, settings, tokens=opening.get("tokens") in (True, "1", "true"))
        return CallStream(session.upload_lines(pcm), bridge.hang_up,
                          headers={"Cache-Control": "no-cache", "X-Call-Id": bridge.id})


CALL_PATHS = ("/v1/realtime", "/generate/ws", "/generate")


class ConnectionLimit:
    """Every open call connection counts against serve.max_connections, whether or not it holds a place yet
    (a native socket before its opening message, an upload being read): one more is refused with 503
    `too_many_connections` (before the upgrade), so idle sockets cannot exhaust the server's file descriptors."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        srv = self.server
        if scope["type"] not in ("http", "websocket") or scope["path"] not in CALL_PATHS:
            return await self.app(scope, receive, send)
        if srv.connections >= srv.max_connections:
            srv.metrics.refusal("too_many_connections")
            refusal = JSONResponse({"type": "error", "code": "too_many_connections", "message": (
                f"{srv.connections} call connections are open; the limit is serve.max_connections = "
                f"{srv.max_connections}")}, status_code=503)
            if scope["type"] == "websocket":
                return await WebSocket(scope, receive, send).send_denial_response(refusal)
            return await refusal(scope, receive, send)
        srv.connections += 1
        srv.metrics.connections.set(srv.connections)
        try:
            await self.app(scope, receive, send)
        finally:
            srv.connections -= 1
            srv.metrics.connections.set(srv.connections)


class CallStream(StreamingResponse):
    """An upload's NDJSON reply: the call's lines as produced; however the response ends (done, the client
    gone), the line generator is closed and the call hung up, so its place comes back."""

    media_type = "application/x-ndjson"

    def __init__(self, lines, on_close, headers: dict):
        super().__init__(lines, headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.on_close()


def uvicorn_config(server: Server, **overrides):
    """How uvicorn serves `server`: WebSocket messages up to serve.max_message_kb (a larger one closes the
    socket with 1009), per-message deflate off (PCM barely compresses; it would only cost CPU)."""
    import uvicorn

    from nemo_duplex.server.transport import http_protocol, websocket_protocol

    cfg = server.cfg
    return uvicorn.Config(server.app(), **{"host": cfg.host, "port": cfg.port,
                                           "http": http_protocol(server.metrics),
                                           "ws": websocket_protocol(server.metrics),
                                           "ws_max_size": cfg.max_message_kb * 1024, "ws_per_message_deflate": False,
                                           "access_log": False, "log_level": "warning", "lifespan": "on",
                                           **overrides})


def uvicorn_server(server: Server, **overrides):
    """The uvicorn server for `server`, which on SIGINT / SIGTERM first drains the calls (Server.drain), then
    closes what is left and stops the engine."""
    import uvicorn

    class Draining(uvicorn.Server):
        async def shutdown(self, sockets=None):
            await server.drain()
            await super().shutdown(sockets)

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            if sig in (signal.SIGTERM, signal.SIGINT) and sig in self._captured_signals:
                # a requested stop (Ctrl-C too), drained: exit status 0; uvicorn would raise the signal again at
                # the end, a KeyboardInterrupt traceback for Ctrl-C (a second Ctrl-C still forces the exit)
                self._captured_signals.remove(sig)

    return Draining(uvicorn_config(server, **overrides))


def serve(server: Server) -> None:
    """Serve until SIGINT / SIGTERM, then drain (exit status 0)."""
    uvicorn_server(server).run()
