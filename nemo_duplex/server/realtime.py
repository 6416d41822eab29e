"""The OpenAI Realtime dialect over one WebSocket: the client's events into the call, the call's frames out
as Realtime server events (the protocol's events themselves: realtime_protocol.py)."""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import math
import time

from nemo_duplex.audio import AudioFormatError, OutputStream
from nemo_duplex.server.bridge import CallBridge, call_options
from nemo_duplex.server.context import ServerContext
from nemo_duplex.server.errors import FATAL_CODES, Fatal, Refusal
from nemo_duplex.server.frames import FrameDecoder
from nemo_duplex.server.realtime_protocol import (
    NO_OP_EVENTS,
    NOT_SUPPORTED_EVENTS,
    OPENAI_VOICES,
    ProtocolError,
    RealtimeOutput,
    SessionSettings,
    decode_audio,
    error_event,
    parse_client_event,
    parse_session,
    session_object,
)
from nemo_duplex.server.tools import on_hold_message
from nemo_duplex.server.ws import CallConnection, Socket
from nemo_duplex.serving.calls import DrainedEvent, EndedEvent, FrameEvent


def session_update(ctx: ServerContext, body: object, current: SessionSettings) -> SessionSettings:
    """A `session.update` body (or a client secret's session) applied to `current` (parse_session), OpenAI's stock
    voice names taken as the checkpoint's voice (session.updated names it)."""
    new = parse_session(body, current, ctx.cfg.max_tools, ctx.max_call_s)
    if new.voice in OPENAI_VOICES and new.voice not in ctx.voices:
        new.voice = None
    return new


def check_settings(ctx: ServerContext, settings: SessionSettings) -> None:
    """What parse_session cannot check alone: the voice, the prompt's length, the sampling values together."""
    ctx.check_voice(settings.voice)
    ctx.check_prompt(settings)
    call_options(settings, settings.voice)


class RealtimeSession(CallConnection):
    """The OpenAI Realtime dialect over a WebSocket (a new one may resume the call: server/resume.py). `settings`:
    where the call starts (a client secret's session, server/client_secrets.py), else the server's defaults."""

    def __init__(self, ctx: ServerContext, bridge: CallBridge, settings: SessionSettings | None = None):
        super().__init__(bridge)
        self.ctx = ctx
        bridge.notify = lambda code, message: bridge.push(error_event(bridge.ids.next("event"), code, message))
        self.settings = copy.deepcopy(settings if settings is not None else ctx.session_defaults)
        self.out = RealtimeOutput(bridge.ids, self.settings.output_modalities,
                                  hangover=max(1, math.ceil(ctx.cfg.speech_hangover_ms / 1000 / ctx.frame_s)),
                                  frame_ms=ctx.frame_s * 1000)
        self.decoder: FrameDecoder | None = None
        self.audio_out: OutputStream | None = None

    def session_body(self, created: bool = False) -> dict:
        s = self.ctx
        body = session_object(self.bridge.id, s.model_name, self.settings, self.settings.voice or s.default_voice,
                              s.capabilities())
        if created and self.token is not None:   # an extension: how to take the call back after a lost connection
            body["resume"] = {"token": self.token, "grace_s": s.cfg.resume_grace_s}
        return body

    async def run(self, socket: Socket) -> bool:
        """The first connection; -> whether its transport was lost (CallConnection.serve)."""
        self.bridge.push(self.out.ev("session.created", session=self.session_body(created=True)))
        return await self.serve(socket)

    async def _read(self, socket: Socket) -> None:
        s, b = self.ctx, self.bridge
        while True:
            input_open = b.call is None or not b.call.input_ended
            try:
                msg = await self.receive(socket, s.cfg.idle_timeout_s if input_open else None)
            except asyncio.TimeoutError:
                b.fail("idle_timeout", f"nothing received for serve.idle_timeout_s = {s.cfg.idle_timeout_s:g} s")
                while (await socket.receive()).kind != "closed":   # until the writer closes it (or the client)
                    pass
                return
            if msg.kind == "closed":
                return
            if b.failed is not None:
                continue
            client_event_id = None
            try:
                if msg.kind == "bytes":
                    raise ProtocolError("invalid_event", "binary frames are not part of the Realtime protocol; "
                                        "send base64 audio in input_audio_buffer.append")
                ev = parse_client_event(msg.data)
                client_event_id = ev.get("event_id") if isinstance(ev.get("event_id"), str) else None
                self._handle(ev)
            except ProtocolError as e:
                s.metrics.refusal(e.code)
                b.push(error_event(b.ids.next("event"), e.code, e.message, e.param, client_event_id))
            except Refusal as r:
                if r.code in FATAL_CODES:
                    b.fail(r.code, r.message)
                else:
                    s.metrics.refusal(r.code)
                    b.push(error_event(b.ids.next("event"), r.code, r.message, None, client_event_id))

    def _handle(self, ev: dict) -> None:
        s, b, kind = self.ctx, self.bridge, ev["type"]
        if kind == "input_audio_buffer.append":
            rate = self.settings.input_format.rate
            for name in ("sample_rate", "sample_rate_hz"):
                if name in ev and ev[name] != rate:
                    raise ProtocolError("invalid_audio_format", f"{name} {ev[name]} Hz: this session's input is "
                                        f"{self.settings.input_format.describe()} (session.audio.input.format)", name)
            data = decode_audio(ev.get("audio"), "audio")
            try:   # before the call opens on it: a bad first message must leave the session unlocked
                self.settings.input_format.check(data)
            except AudioFormatError as e:
                raise ProtocolError("invalid_audio", str(e), "audio") from None
            self._ensure_call()
            b.append_audio(data)
        elif kind == "session.update":
            new = session_update(s, ev.get("session"), self.settings)
            if b.call is not None:
                # once audio has started the prompt is in the model: an update that changes nothing is
                # acknowledged (clients such as the Agents SDK send their configuration again), others refused
                changed = [f.name for f in dataclasses.fields(new) if getattr(new, f.name) != getattr(self.settings,
                                                                                                  f.name)]
                if changed:
                    raise ProtocolError("session_locked", f"{', '.join(changed)}: session settings are fixed once "
                                        "audio has started (the system prompt is already in the model)",
                                        f"session.{changed[0]}")
                b.push(self.out.ev("session.updated", session=self.session_body()))
                return
            check_settings(s, new)
            self.settings = new
            self.out.set_modalities(new.output_modalities)
            b.push(self.out.ev("session.updated", session=self.session_body()))
        elif kind == "input_audio_buffer.commit":
            final = any(ev.get(k) is True for k in ("final", "end_of_input", "pad_partial"))
            if final and b.call is not None and b.call.input_ended:
                raise Refusal("append_after_end", "input already ended")
            if final:   # committed once every frame is heard (at the drain), with the whole transcript
                self._ensure_call()
                b.end_input()
            else:
                for e in self.out.commit():
                    b.push(e)
        elif kind == "input_audio_buffer.clear":
            if b.call is not None:
                b.clear_input()
            b.push(self.out.ev("input_audio_buffer.cleared"))
        elif kind == "conversation.item.create":
            item = ev.get("item")
            if not isinstance(item, dict):
                raise ProtocolError("invalid_event", "item must be an object", "item")
            if item.get("type") != "function_call_output":
                raise ProtocolError("not_supported", "only function_call_output items can be added to a "
                                    "full-duplex call (the model hears audio only)", "item.type")
            if b.call is None:
                raise Refusal("unknown_function_call", "no function call has been made in this call")
            b.tool_output(item.get("call_id"), item.get("output", ""))
            b.push(self.out.ev("conversation.item.added", previous_item_id=None,
                               item={"id": item.get("id") or b.ids.next("item"), "object": "realtime.item",
                                     "type": "function_call_output", "call_id": item.get("call_id"),
                                     "output": item.get("output", ""), "status": "completed"}))
        elif kind == "response.cancel":
            for e in self.out.cancel():
                b.push(e)
        elif kind == "session.close":
            if b.call is not None and not b.engine_ended:   # EndedEvent(closed) -> session.closed
                b.call.abort("closed", "the client closed the session")
            else:
                b.push(self.out.ev("session.closed", reason="closed"))
                b.push(Fatal("", ""))
        elif kind == "session.ping":
            b.push(self.out.ev("session.pong"))
        elif kind in NO_OP_EVENTS:
            pass
        elif kind in NOT_SUPPORTED_EVENTS:
            raise ProtocolError("not_supported", f"{kind} has no meaning for a full-duplex model here", "type")
        else:
            raise ProtocolError("unknown_event", f"unknown event type {kind!r}", "type")

    def _ensure_call(self) -> None:
        b, s = self.bridge, self.ctx
        if b.call is None:
            b.open(call_options(self.settings, self.settings.voice), self.settings.input_format)
            self.decoder = FrameDecoder(s.tokenizer, s.rnnt_vocab, s.tokens, b.ids, s.cfg.max_tool_call_tokens)
            self.audio_out = OutputStream(self.settings.output_format, s.out_rate)

    async def _write(self, socket: Socket) -> None:
        s, b = self.ctx, self.bridge

        def text(*events) -> list[str]:
            return [json.dumps(e) for e in events]

        while True:
            item = await b.next()
            if isinstance(item, Fatal):
                if not item.code:
                    return await self.finish(socket, 1000, "closed")
                closing = self.out.close("failed", None)
                return await self.finish(socket, 1008, item.code, *text(
                    *closing, error_event(b.ids.next("event"), item.code, item.message)))
            if isinstance(item, dict):
                await self.send(socket, *text(item))
            elif isinstance(item, FrameEvent):
                out = self.decoder(item, self.audio_out if self.out.audio else None)
                for t in out.tool_calls:
                    b.tool_called(t, on_hold_message(self.settings, t.name))
                await self.send(socket, *text(*self.out.frame(out)))
                s.metrics.frame_sent(time.monotonic() - item.ready_at)
            elif isinstance(item, DrainedEvent):
                tail = self.out.audio_tail(self.audio_out.flush(), item.frames - 1) if self.audio_out else []
                # the input ended: so did the user's speech, and its final commit takes effect
                events = tail + (self.out.speech_stopped() or self.out.commit())
                await self.send(socket, *text(*events, self.out.ev("input_audio_buffer.drained", frames=item.frames)))
            elif isinstance(item, EndedEvent):
                fatal = s.limit_message(item)
                if fatal is not None:
                    s.metrics.refusal(fatal.code)
                    closing = self.out.close("incomplete", None)
                    return await self.finish(socket, 1008, fatal.code, *text(
                        *closing, error_event(b.ids.next("event"), fatal.code, fatal.message)))
                closing = self.out.close("completed")
                return await self.finish(socket, 1000, "completed", *text(
                    *closing, self.out.ev("session.closed", reason=item.reason)))
