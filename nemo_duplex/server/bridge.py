"""One call between a connection and the engine: the engine's events handed to the event loop, a bounded
outbox per connection, the call's tool ledger.

Threads: the engine steps on its own thread; its events reach the loop through a `Handover` (one
`loop.call_soon_threadsafe` per burst, not per event), land in the call's outbox, and the session's writer
sends them in order. A client that stops reading fills its outbox; past `serve.max_outbound_frames` its
call ends with `slow_consumer`, the others never notice."""
from __future__ import annotations

import asyncio
import json
from collections import deque

import numpy as np

from nemo_duplex.audio import AudioFormat, AudioFormatError, InputStream
from nemo_duplex.models.config import SamplingParams
from nemo_duplex.server.context import ServerContext
from nemo_duplex.server.errors import Fatal, Refusal
from nemo_duplex.server.frames import ToolCall
from nemo_duplex.server.realtime_protocol import EventIds, SessionSettings
from nemo_duplex.server.tools import render_tool_prompt, tool_response_ids
from nemo_duplex.serving.calls import CallClosed, CallOptions, EndedEvent, EngineBusy, FrameEvent, InputBudgetExceeded


class CallBridge:
    """A connection's place on the server: its engine call (opened on the first audio), its bounded
    outbox, its tool ledger. Methods run on the event loop, except `_from_engine`."""

    def __init__(self, ctx: ServerContext, call_id: str):
        self.ctx, self.id = ctx, call_id
        self.loop = asyncio.get_running_loop()
        self.handover = ctx.handover(self.loop)
        self.ids = EventIds(call_id)
        self.call = None
        self.outbox: deque = deque()
        self.frames_waiting = 0
        self._wake = asyncio.Event()
        self.failed: Fatal | None = None
        self.engine_ended = False
        self.socket_done = False
        self.frames_seen = 0
        self.tool_calls: dict[str, ToolCall] = {}
        self.tools_answered: set[str] = set()
        self._due: list[tuple[int, list[int]]] = []   # (frame at which to inject, tokens)
        self._holds: list[tuple[str, list[int]]] = []  # (call_id, on-hold message tokens) to speak once silent
        self._timeouts: dict[str, asyncio.TimerHandle] = {}
        self.notify = lambda code, message: None   # the session's way to tell its client (a non-fatal error)
        self._cut: asyncio.TimerHandle | None = None
        self.cut = None   # the session's way to drop its connection (cancels its tasks); None before it runs

    # -- engine side
    def open(self, options: CallOptions, input_format: AudioFormat | None = None) -> None:
        """Open the engine call; `input_format`: what the caller's audio messages hold (None: the model's
        own rate in PCM16: uploads, decoded whole)."""
        self.input_format = input_format or AudioFormat("pcm16", self.ctx.in_rate)
        self.input = InputStream(self.input_format, self.ctx.in_rate)
        try:
            self.call = self.ctx.engine.open_call(options, self._from_engine, self.id)
        except EngineBusy as e:
            raise Refusal(e.code, str(e), 503) from None

    def _from_engine(self, ev) -> None:   # engine thread: hand over, never block
        self.handover.put(self, ev)

    def on_event(self, ev) -> None:   # event loop (Handover)
        if isinstance(ev, EndedEvent):
            self.engine_ended = True
            self.ctx.metrics.call_ended(ev.reason)
            if self.socket_done:
                self.ctx.forget(self)
            elif self.cut is not None and self._cut is None:
                self._arm_cut()
        if self.failed is not None:
            return
        if isinstance(ev, FrameEvent):
            self.frames_seen = ev.frame + 1
            self._inject_due()
            self._speak_holds(ev)
            if self.frames_waiting >= self.ctx.cfg.max_outbound_frames:
                self.fail("slow_consumer", f"the client fell {self.frames_waiting} frames behind; the limit is "
                          f"serve.max_outbound_frames = {self.ctx.cfg.max_outbound_frames}")
                return
            self.frames_waiting += 1
        self.outbox.append(ev)
        self._wake.set()

    # -- connection side
    def push(self, item) -> None:
        """Queue a ready-made message (a dict) for the writer, after whatever is already queued."""
        if self.failed is None:
            self.outbox.append(item)
            self._wake.set()

    async def next(self):
        while not self.outbox:
            self._wake.clear()
            await self._wake.wait()
        item = self.outbox.popleft()
        if isinstance(item, FrameEvent):
            self.frames_waiting -= 1
        return item

    def fail(self, code: str, message: str) -> None:
        """End the call with an error: queued output is dropped, the error goes out, the socket closes
        (cut after serve.slow_consumer_grace_s if the client does not take it)."""
        if self.failed is not None:
            return
        self.ctx.metrics.refusal(code)
        if self.call is not None and not self.engine_ended:
            self.call.abort(code, message)
        self.outbox.clear()
        self.frames_waiting = 0
        self.outbox.append(Fatal(code, message))
        self.failed = self.outbox[-1]
        self._wake.set()
        if self.cut is not None:
            if self._cut is not None:
                self._cut.cancel()
            self._cut = self.loop.call_later(self.ctx.cfg.slow_consumer_grace_s, self._cut_if_stuck)

    def attach(self, cut) -> None:
        """A connection serves the call from now on (the first, or one resuming it: server/resume.py); `cut` drops
        it. A call that ended or failed while it had none gets its cut deadline now, as on_event would have."""
        self.cut = cut
        if (self.engine_ended or self.failed is not None) and self._cut is None:
            self._arm_cut()

    def _arm_cut(self) -> None:
        """The call is over; its socket must follow. A client that stopped reading would keep the writer
        waiting on the send buffer for ever, and its server place with it: cut once a client reading at
        playback rate would have had everything still queued."""
        queued_s = self.frames_waiting * self.ctx.frame_s
        self._cut = self.loop.call_later(self.ctx.cfg.slow_consumer_grace_s + queued_s, self._cut_if_stuck)

    def detach(self) -> None:
        """The connection is gone; the call is parked until a new one attaches or its grace runs out."""
        self.cut = None
        if self._cut is not None:
            self._cut.cancel()
            self._cut = None

    def _cut_if_stuck(self) -> None:
        """The connection outlived its grace after the error or the call's end: drop it. Whether the writer
        is still behind queued output or has taken the error, a client that does not read keeps it waiting
        on the send buffer's drain, and its place on the server with it. A client that reads has closed
        long before."""
        if not self.socket_done and self.cut is not None:
            self.cut()

    def hang_up(self, message: str = "the client disconnected") -> None:
        """The connection is gone: end the call (if any) and release the place once the engine agrees."""
        self.socket_done = True
        for timer in self._timeouts.values():
            timer.cancel()
        self._timeouts.clear()
        if self._cut is not None:
            self._cut.cancel()
        if self.call is not None and not self.engine_ended:
            self.call.abort("hangup", message)
        if self.call is None or self.engine_ended:
            self.ctx.forget(self)

    # -- input
    def append_audio(self, data: bytes) -> None:
        """A message of the caller's audio, in its format (converted to the model's rate, streaming)."""
        try:
            pcm = self.input(data)
        except AudioFormatError as e:
            raise Refusal("invalid_audio", str(e)) from None
        self.append(pcm)

    def end_input(self) -> None:
        """No more audio: what the resampler still holds goes in, then the call's end of input."""
        if not self.call.input_ended:
            tail = self.input.flush()
            if tail.size:
                self.append(tail)
        self.call.end_input()

    def clear_input(self) -> None:
        """Drop the audio received but not yet stepped (input_audio_buffer.clear), and the resampler's."""
        self.call.clear_pending()
        self.input = InputStream(self.input_format, self.ctx.in_rate)

    def append(self, pcm: np.ndarray) -> None:
        try:
            self.call.append(pcm)
        except InputBudgetExceeded as e:
            raise Refusal("input_budget_exceeded", str(e), 413) from None
        except CallClosed:
            if self.call.input_ended:
                raise Refusal("append_after_end", "audio after end of input is refused") from None
            raise Refusal("call_ended", "the call has ended; no more audio is taken") from None

    # -- tools (spec 3.9)
    def tool_called(self, call: ToolCall, on_hold_message: str | None) -> None:
        """The model called a tool: its result is awaited for serve.tool_timeout_s, and its on-hold message
        (if the tool has one) is spoken as soon as the agent is silent, until the result comes."""
        self.tool_calls[call.call_id] = call
        self._timeouts[call.call_id] = self.loop.call_later(self.ctx.cfg.tool_timeout_s, self._tool_timed_out,
                                                            call.call_id)
        if on_hold_message:
            t = self.ctx.tokens
            ids = [t.bos_id] + self.ctx.tokenizer.encode(on_hold_message) + [t.eos_id]
            self._holds.append((call.call_id, ids))

    def _tool_timed_out(self, call_id: str) -> None:
        self._timeouts.pop(call_id, None)
        if call_id in self.tools_answered or self.failed is not None or self.engine_ended:
            return
        t = self.ctx.cfg.tool_timeout_s
        self.tool_output(call_id, json.dumps({"error": f"the tool did not answer within {t:g} s"}))
        self.ctx.metrics.refusal("tool_timeout")
        self.notify("tool_timeout", f"function call {call_id} got no output within serve.tool_timeout_s = {t:g} s; "
                    "the model was given an error result")

    def _speak_holds(self, ev: FrameEvent) -> None:
        """An agent silent on this frame (PAD on its text channel) speaks the on-hold messages of the tools
        still running."""
        if not self._holds or ev.text != self.ctx.tokens.pad_id:
            return
        for call_id, ids in self._holds:
            if call_id not in self.tools_answered:
                self.call.inject_text_tokens(ids)
        self._holds = []

    def tool_output(self, call_id: object, output: object) -> None:
        if not isinstance(call_id, str) or call_id not in self.tool_calls:
            raise Refusal("unknown_function_call", f"no function call with call_id {call_id!r} in this call")
        if call_id in self.tools_answered:
            raise Refusal("duplicate_function_call_output", f"call_id {call_id} was already answered")
        if not isinstance(output, str):
            output = json.dumps(output)
        ids = tool_response_ids(self.ctx.tokenizer, output, self.ctx.cfg.max_tool_output_tokens)
        self.tools_answered.add(call_id)
        if (timer := self._timeouts.pop(call_id, None)) is not None:
            timer.cancel()
        due = self.tool_calls[call_id].frame + 1 + self.ctx.cfg.tool_on_hold_min_frames
        self._due.append((due, ids))
        self._inject_due()

    def _inject_due(self) -> None:
        if self.call is None:
            return
        keep = []
        for due, ids in self._due:
            if self.frames_seen >= due:
                self.call.inject_function_tokens(ids)
            else:
                keep.append((due, ids))
        self._due = keep


def call_options(settings: SessionSettings, voice: str | None) -> CallOptions:
    try:
        sampling = SamplingParams(settings.temperature, settings.top_p, settings.repetition_penalty)
    except ValueError as e:
        raise Refusal("invalid_sampling", str(e)) from None
    return CallOptions(prompt=render_tool_prompt(settings.instructions, settings.tools), seed=settings.seed,
                       sampling=sampling, speaker=voice, max_call_s=settings.max_call_s)
