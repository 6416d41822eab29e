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

from nemo_duplex.audio import from_pcm16
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
        self._cut: asyncio.TimerHandle | None = None
        self.cut = None   # the session's way to drop its connection (cancels its tasks); None before it runs

    # -- engine side
    def open(self, options: CallOptions) -> None:
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
                # The call is over; its socket must follow. A client that stopped reading would keep the
                # writer waiting on the send buffer for ever, and its server place with it: cut once a
                # client reading at playback rate would have had everything still queued.
                queued_s = self.frames_waiting * self.ctx.frame_s
                self._cut = self.loop.call_later(self.ctx.cfg.slow_consumer_grace_s + queued_s,
                                                 self._cut_if_stuck)
        if self.failed is not None:
            return
        if isinstance(ev, FrameEvent):
            self.frames_seen = ev.frame + 1
            self._inject_due()
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

    def _cut_if_stuck(self) -> None:
        """The connection outlived its grace after the error or the call's end: drop it. Whether the writer
        is still behind queued output or has taken the error, a client that does not read keeps it waiting
        on the send buffer's drain, and its place on the server with it. A client that reads has closed
        long before."""
        if not self.socket_done and self.cut is not None:
            self.cut()

    def hang_up(self) -> None:
        """The connection is gone: end the call (if any) and release the place once the engine agrees."""
        self.socket_done = True
        if self._cut is not None:
            self._cut.cancel()
        if self.call is not None and not self.engine_ended:
            self.call.abort("hangup", "the client disconnected")
        if self.call is None or self.engine_ended:
            self.ctx.forget(self)

    # -- input
    def append_pcm16(self, data: bytes) -> None:
        if len(data) % 2:
            raise Refusal("invalid_audio", f"{len(data)} bytes of audio; PCM16 needs an even count")
        self.append(from_pcm16(data))

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
    def tool_output(self, call_id: object, output: object) -> None:
        if not isinstance(call_id, str) or call_id not in self.tool_calls:
            raise Refusal("unknown_function_call", f"no function call with call_id {call_id!r} in this call")
        if call_id in self.tools_answered:
            raise Refusal("duplicate_function_call_output", f"call_id {call_id} was already answered")
        if not isinstance(output, str):
            output = json.dumps(output)
        ids = tool_response_ids(self.ctx.tokenizer, output, self.ctx.cfg.max_tool_output_tokens)
        self.tools_answered.add(call_id)
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
                       sampling=sampling, speaker=voice)
