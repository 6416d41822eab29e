"""The native protocol: WS /generate/ws (a JSON opening message, binary PCM both ways, JSON events) and
POST /generate (a WAV in; the same events and audio back as NDJSON while they are produced).
docs/protocol.md has the wire formats."""
from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from typing import AsyncIterator

import numpy as np
from starlette.datastructures import Headers
from starlette.requests import Request

from nemo_duplex.audio import ENCODINGS, G711_RATE, AudioFormat, AudioFormatError, OutputStream
from nemo_duplex.server.bridge import CallBridge
from nemo_duplex.server.context import ServerContext
from nemo_duplex.server.errors import FATAL_CODES, Fatal, Refusal
from nemo_duplex.server.frames import FrameDecoder, FrameOutputs
from nemo_duplex.server.realtime_protocol import (
    ProtocolError,
    SessionSettings,
    field_of,
    parse_client_event,
    parse_session,
)
from nemo_duplex.server.tools import on_hold_message
from nemo_duplex.server.ws import CallConnection, Socket
from nemo_duplex.serving.calls import DrainedEvent, EndedEvent, FrameEvent

HEADER = struct.Struct("<If")   # frame index, server lag in ms; then the PCM16 samples


# ---- the opening: /generate/ws's first message, POST /generate's query or form fields -------------------
def native_opening(ctx: ServerContext, ev: dict, call_id: str | None) -> tuple[SessionSettings, str | None, str | None]:
    """-> (settings, voice, call id), or ProtocolError naming the field."""
    if ev.get("type", "start") != "start":
        raise ProtocolError("invalid_event", f"the opening message must have type 'start', got {ev['type']!r}", "type")
    if ev.get("sample_width", 2) != 2:
        raise ProtocolError("invalid_audio_format", f"sample_width {ev['sample_width']}: PCM is 16-bit (2) here; "
                            "8-bit audio is G.711 (format pcmu or pcma)", "sample_width")
    # max_call_s: the call's own limit (an extension, as in session.update), checked by parse_session
    session = {k: ev[k] for k in ("instructions", "tools", "seed", "temperature", "top_p",
                                  "repetition_penalty", "voice", "max_call_s") if k in ev}
    if "prompt" in ev:
        session["instructions"] = ev["prompt"]
    settings = parse_session(session, ctx.session_defaults, ctx.cfg.max_tools, ctx.max_call_s)
    settings.input_format = wire_format(ev, "", ctx.in_rate, channels=True)
    settings.output_format = wire_format(ev, "output_", ctx.out_rate)
    ctx.check_voice(settings.voice)
    ctx.check_prompt(settings)
    cid = field_of(ev, "call_id", str, "start") or call_id
    return settings, settings.voice, cid


FORMAT_NAMES = {name: encoding for encoding, spec in ENCODINGS.items() for name in spec.native_names}


def wire_format(ev: dict, prefix: str, model_rate: int, channels: bool = False) -> AudioFormat:
    """`<prefix>format` (pcm16 | pcmu | pcma) at `<prefix>sample_rate` (the model's own rate by default, 8000
    for G.711), with `channels` on input: the opening's (or an upload's fields') audio format."""
    name = ev.get(prefix + "format", "pcm16")
    if name not in FORMAT_NAMES:
        raise ProtocolError("invalid_audio_format", f"{prefix}format {name!r}: one of {sorted(FORMAT_NAMES)}",
                            prefix + "format")
    encoding = FORMAT_NAMES[name]
    rate = ev.get(prefix + "sample_rate", model_rate if encoding == "pcm16" else G711_RATE)
    try:
        return AudioFormat(encoding, rate, ev.get("channels", 1) if channels else 1)
    except (AudioFormatError, TypeError) as e:
        raise ProtocolError("invalid_audio_format", f"{prefix}format: {e}", prefix + "sample_rate") from None


def typed_fields(fields: dict) -> dict:
    """Form/query strings -> the JSON types the opening message uses."""
    out = {}
    for k, v in fields.items():
        if k in ("seed", "sample_rate", "output_sample_rate", "channels", "sample_width"):
            try:
                v = int(v)
            except ValueError:
                raise ProtocolError("invalid_event", f"{k} must be an integer", k) from None
        elif k in ("temperature", "top_p", "repetition_penalty", "max_call_s"):
            try:
                v = float(v)
            except ValueError:
                raise ProtocolError("invalid_event", f"{k} must be a number", k) from None
        elif k == "tools":
            try:
                v = json.loads(v)
            except ValueError:
                raise ProtocolError("invalid_event", "tools must be a JSON list", k) from None
        out[k] = v
    return out


MULTIPART_SLACK = 65536   # a multipart body's boundaries and headers beside its WAV


async def read_body(request: Request, cap: int, too_large: Refusal | None = None) -> bytes:
    """A request's body, refused (`too_large`, else 413 body_too_large) once it is past `cap` bytes: by its
    Content-Length before any of it is read, or while it is read (a chunked body has none)."""
    too_large = too_large or Refusal("body_too_large", f"the request body is larger than {cap} bytes", 413)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise too_large
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > cap:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def read_upload(request: Request, max_upload_mb: float) -> tuple[dict, bytes]:
    """-> (fields, WAV bytes). The body is the WAV itself (settings in the query string), or
    multipart/form-data with a file field `audio` (or `file`) and the settings as fields. The whole body
    is capped at serve.max_upload_mb (plus the multipart slack) while it is read."""
    limit = int(max_upload_mb * 2 ** 20)
    too_large = Refusal("upload_too_large", f"the upload is larger than serve.max_upload_mb = {max_upload_mb:g} MiB",
                        413)
    multipart = request.headers.get("content-type", "").startswith("multipart/")
    body = await read_body(request, limit + (MULTIPART_SLACK if multipart else 0), too_large)
    fields: dict = dict(request.query_params)
    if not multipart:
        wav = body
    else:
        wav = await _multipart(request.headers, body, limit, fields)
    if not wav:
        raise Refusal("invalid_audio_format", "no WAV in the request (raw body, or a multipart field 'audio')")
    if len(wav) > limit:
        raise too_large
    return typed_fields(fields), wav


async def _multipart(headers: Headers, body: bytes, limit: int, fields: dict) -> bytes | None:
    from starlette.datastructures import UploadFile
    from starlette.formparsers import MultiPartException, MultiPartParser

    async def stream():
        yield body

    boundary = headers.get("content-type", "").partition("boundary=")[2].split(";")[0].strip().strip('"')
    if not boundary:
        raise Refusal("invalid_upload", "the multipart/form-data body does not parse: no boundary", 400)
    if not body.rstrip(b"\r\n").endswith(b"--" + boundary.encode() + b"--"):
        raise Refusal("invalid_upload", "the multipart/form-data body does not parse: it ends inside a part "
                      "(no closing boundary)", 400)
    try:
        form = await MultiPartParser(headers, stream(), max_files=2, max_fields=32, max_part_size=limit).parse()
    except (MultiPartException, ValueError, AssertionError) as e:
        raise Refusal("invalid_upload", f"the multipart/form-data body does not parse: {e}", 400) from None
    wav = None
    try:
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                if name in ("audio", "file"):
                    wav = await value.read()
            elif name in ("audio", "file"):
                wav = value.encode("latin-1", errors="replace")
            else:
                fields[name] = value
    finally:
        await form.close()
    return wav


# ---- a call ------------------------------------------------------------------------------------------------
class NativeSession(CallConnection):
    """A native call: over a WebSocket (a new one may resume it: server/resume.py), or an upload's reply."""

    def __init__(self, ctx: ServerContext, bridge: CallBridge, settings: SessionSettings, tokens: bool = False):
        super().__init__(bridge)
        self.ctx = ctx
        self.tokens = tokens   # opening {"tokens": true}: also send each frame's raw token ids
        self.settings = settings
        self.decoder = FrameDecoder(ctx.tokenizer, ctx.rnnt_vocab, ctx.tokens, bridge.ids, ctx.cfg.max_tool_call_tokens)
        self.audio_out = OutputStream(settings.output_format, ctx.out_rate)
        bridge.notify = lambda code, message: bridge.push({"type": "error", "code": code, "message": message})

    def started(self) -> dict:
        c, fin, fout = self.ctx, self.settings.input_format, self.settings.output_format
        resume = {"resume": {"token": self.token, "grace_s": c.cfg.resume_grace_s}} if self.token else {}
        return {"type": "started", "call_id": self.bridge.id, **resume,
                "input": {"format": fin.encoding, "sample_rate": fin.rate, "channels": fin.channels,
                          "model_sample_rate": c.in_rate, "frame_samples": c.frame_in},
                "output": {"format": fout.encoding, "sample_rate": fout.rate, "channels": 1,
                           "model_sample_rate": c.out_rate, "frame_samples": c.frame_out,
                           "header": "<If: frame, lag_ms"},
                # the call's own max_call_s when it declared one, else the server's
                "limits": {"max_call_s": c.call_limit(self.settings), "max_pending_s": c.max_pending_s,
                           "max_outbound_frames": c.cfg.max_outbound_frames}}

    def events(self, item) -> tuple[FrameOutputs | None, list[dict], Fatal | None, bool]:
        """An outbox item -> (frame outputs, JSON events, fatal error, call over)."""
        c, b = self.ctx, self.bridge
        if isinstance(item, Fatal):
            return None, [], item, True
        if isinstance(item, dict):
            return None, [item], None, False
        if isinstance(item, FrameEvent):
            out = self.decoder(item, self.audio_out)
            k = out.frame
            evs = [{"type": "tokens", "frame": k, "text": item.text, "func": item.func, "user": item.user}
                   ] if self.tokens else []
            if out.turn_start:
                evs.append({"type": "turn", "frame": k, "event": "start"})
            if out.text_delta:
                evs.append({"type": "text", "frame": k, "delta": out.text_delta})
            if out.turn_end:
                evs.append({"type": "turn", "frame": k, "event": "end"})
            if out.user_delta:
                evs.append({"type": "transcript", "frame": k, "delta": out.user_delta})
            for t in out.tool_calls:
                b.tool_called(t, on_hold_message(self.settings, t.name))
                evs.append({"type": "function_call", "frame": k, "call_id": t.call_id, "name": t.name,
                            "arguments": t.arguments})
            for m in out.tool_errors:
                c.metrics.refusal("function_call_parse_error")
                evs.append({"type": "error", "frame": k, "code": "function_call_parse_error", "message": m})
            # the lag the client gets in the header is /metrics' frame lag: input received -> packet sent
            out.lag_s = time.monotonic() - item.ready_at
            c.metrics.frame_sent(out.lag_s)
            return out, evs, None, False
        if isinstance(item, DrainedEvent):
            # at an output rate of the caller's own, the resampler's tail (tens of ms) as one more packet,
            # numbered one past the last frame
            tail = self.audio_out.flush()
            out = FrameOutputs(item.frames, tail, "", False, False, "") if tail else None
            return out, [{"type": "drained", "frames": item.frames}], None, False
        if isinstance(item, EndedEvent):
            fatal = c.limit_message(item)
            if fatal is not None:
                c.metrics.refusal(fatal.code)
                return None, [], fatal, True
            return None, [{"type": "ended", "reason": item.reason}], None, True
        raise TypeError(item)

    # -- /generate/ws
    async def run_ws(self, socket: Socket) -> bool:
        """The first connection; -> whether its transport was lost (CallConnection.serve)."""
        self.bridge.push(self.started())
        return await self.serve(socket)

    async def _read(self, socket: Socket) -> None:
        c, b = self.ctx, self.bridge
        while True:
            try:
                msg = await self.receive(socket, c.cfg.idle_timeout_s if not b.call.input_ended else None)
            except asyncio.TimeoutError:
                b.fail("idle_timeout", f"nothing received for serve.idle_timeout_s = {c.cfg.idle_timeout_s:g} s")
                continue
            if msg.kind == "closed":
                return
            if b.failed is not None:
                continue
            try:
                if msg.kind == "bytes":
                    b.append_audio(msg.data)
                    continue
                ev = parse_client_event(msg.data)
                kind = ev["type"]
                if kind == "end_input":
                    b.end_input()
                elif kind == "tool_output":
                    b.tool_output(ev.get("call_id"), ev.get("output", ""))
                elif kind == "abort":   # -> EndedEvent(aborted) -> {"type": "ended", "reason": "aborted"}
                    b.call.abort("aborted", "the client aborted the call")
                elif kind == "start":
                    raise ProtocolError("invalid_event", "the call has already started", "type")
                else:
                    raise ProtocolError("unknown_event", f"unknown event type {kind!r}", "type")
            except ProtocolError as e:
                c.metrics.refusal(e.code)
                b.push({"type": "error", "code": e.code, "message": e.message, "param": e.param})
            except Refusal as r:
                if r.code in FATAL_CODES:
                    b.fail(r.code, r.message)
                else:
                    c.metrics.refusal(r.code)
                    b.push({"type": "error", "code": r.code, "message": r.message})

    async def _write(self, socket: Socket) -> None:
        while True:
            item = await self.bridge.next()
            out, evs, fatal, over = self.events(item)
            messages = [HEADER.pack(out.frame, out.lag_s * 1000.0) + out.pcm16] if out is not None else []
            messages += [json.dumps(e) for e in evs]
            if fatal is not None:
                messages.append(json.dumps({"type": "error", "code": fatal.code, "message": fatal.message}))
                return await self.finish(socket, 1008, fatal.code, *messages)
            if over:
                return await self.finish(socket, 1000, "completed", *messages)
            await self.send(socket, *messages)

    # -- POST /generate
    async def upload_lines(self, pcm: np.ndarray) -> AsyncIterator[bytes]:
        """The NDJSON reply, line by line as the call produces it; the input is fed meanwhile."""
        feeder = asyncio.create_task(self._feed(pcm))
        try:
            yield (json.dumps(self.started()) + "\n").encode()
            while True:
                item = await self.bridge.next()
                out, evs, fatal, over = self.events(item)
                lines = []
                if out is not None:
                    lines.append({"type": "audio", "frame": out.frame, "lag_ms": round(out.lag_s * 1000.0, 2),
                                  "pcm16": base64.b64encode(out.pcm16).decode()})
                lines += evs
                if fatal is not None:
                    lines.append({"type": "error", "code": fatal.code, "message": fatal.message})
                if lines:
                    yield "".join(json.dumps(e) + "\n" for e in lines).encode()
                if over:
                    return
        finally:
            feeder.cancel()

    async def _feed(self, pcm: np.ndarray) -> None:
        """An upload enters the call as fast as the engine takes it, but never more than half the
        pending-input budget ahead (the budget protects the engine from live clients too)."""
        b, c = self.bridge, self.ctx
        n = c.frame_in
        ahead = max(1, int(c.max_pending_s / c.frame_s) // 2)
        pos = 0
        while pos < pcm.size and b.failed is None and not b.engine_ended:
            room = ahead - b.call.pending_frames
            if room <= 0:
                await asyncio.sleep(c.frame_s / 2)
                continue
            b.append(pcm[pos: pos + room * n])
            pos += room * n
        if b.failed is None and not b.engine_ended:
            b.call.end_input()
