"""The aiohttp server: many callers at once on one engine, with hard limits and clear refusals.

Routes (docs/protocol.md has the wire formats and every error code):
  WS   /v1/realtime   OpenAI Realtime (GA names; beta spellings accepted on input), nemo_duplex/server/realtime.py
  WS   /generate/ws   the lean native protocol: JSON opening message, binary PCM both ways, JSON events
  POST /generate      upload a WAV, get the same events and audio back as NDJSON while they are produced
  GET  /health        200 once warm-up is done and the engine thread is alive, else 503
  GET  /metrics       Prometheus text
  GET  /              the browser page (static/index.html)

Threads: the engine steps on its own thread (engine.py); this event loop only moves bytes. Engine events
reach the loop through a `Handover` (one `loop.call_soon_threadsafe` per burst, not per event), land in
the call's bounded outbox, and one writer task per connection sends them in order. A client that stops
reading fills its outbox; past `serve.max_outbound_frames` its call ends with `slow_consumer`, the others
never notice.

Slots: a connection reserves one of `engine.max_calls` places when it arrives (refused with `busy` when
none is free, never queued) and gives it back only once the engine has ended its call, so the server
never promises a slot the engine does not have.
"""
from __future__ import annotations

import asyncio
import base64
import copy
import gc
import json
import logging
import socket
import struct
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from aiohttp import WSMsgType, web

from nemo_duplex.audio import AudioFormatError, decode_wav, from_pcm16, wav_info
from nemo_duplex.models.config import SamplingParams
from nemo_duplex.server.metrics import ServerMetrics
from nemo_duplex.server.realtime import (
    NO_OP_EVENTS,
    NOT_SUPPORTED_EVENTS,
    EventIds,
    ProtocolError,
    RealtimeOutput,
    SessionSettings,
    decode_audio,
    error_event,
    field_of,
    parse_client_event,
    parse_session,
    session_object,
)
from nemo_duplex.serving.calls import (
    CallClosed,
    CallOptions,
    DrainedEvent,
    EndedEvent,
    EngineBusy,
    FrameEvent,
    InputBudgetExceeded,
    PromptTooLong,
)
from nemo_duplex.settings import ServeConfig

STATIC = Path(__file__).resolve().parent / "static"
log = logging.getLogger("nemo_duplex.server.app")


class Refusal(Exception):
    """A request we turn down; `code` is the documented error code, `status` the HTTP status."""

    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


# =====================================================================================================
# What a frame says: agent text by turn, the user transcript, tool calls on the function channel
# =====================================================================================================
@dataclass
class ToolCall:
    call_id: str
    item_id: str
    name: str
    arguments: str      # JSON text
    frame: int          # frame on which <SPECIAL_21> closed the call


@dataclass
class FrameOutputs:
    frame: int
    pcm16: bytes                 # 1764 little-endian int16 samples at 22.05 kHz
    text_delta: str              # new agent text (display decoding drops specials, spec 3.8)
    turn_start: bool             # BOS on the text channel
    turn_end: bool               # EOS on the text channel
    user_delta: str              # new RNN-T user transcript text
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    lag_s: float = 0.0           # engine: last input sample of the frame -> frame handed out


class IncrementalText:
    """Decode a growing token list and hand out only the new text. Byte-level BPE can split a
    character over tokens, so a decode ending in U+FFFD waits for the next token. Past `fold` ids the
    list is cut back to its last `keep` (decoding context for the next token), so a long turn costs
    O(1) per frame. fold 32, not 256: the decodes run on the event loop for every call's every frame, and
    with 256 the text and transcript of one frame cost ~100 us (random weights emit a token every frame
    and the RNN-T ten; ~13 ms of loop time per 80 ms at 128 calls), with 32 ~30 us (this machine's CPU)."""

    def __init__(self, decode, fold: int = 32, keep: int = 8):
        self.decode, self.ids, self.sent = decode, [], ""
        self.fold, self.keep = fold, keep

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        if not text.startswith(self.sent):   # a merge changed earlier characters: resend from the split
            k = 0
            while k < min(len(text), len(self.sent)) and text[k] == self.sent[k]:
                k += 1
            self.sent = self.sent[:k]
        delta, self.sent = text[len(self.sent):], text
        if len(self.ids) > self.fold:
            self.ids = self.ids[-self.keep:]
            self.sent = self.decode(self.ids)
        return delta

    def reset(self) -> None:
        self.ids, self.sent = [], ""


def parse_tool_calls(text: str) -> list[tuple[str, str]]:
    """`<TOOLCALL>[{"name": ..., "arguments": ...}, ...]</TOOLCALL>` -> [(name, arguments JSON)] (spec 3.9:
    arguments are an object or a JSON string). Raises ValueError with the reason."""
    text = text.strip()
    start, end = "<TOOLCALL>", "</TOOLCALL>"
    if not (text.startswith(start) and text.endswith(end)):
        raise ValueError(f"expected <TOOLCALL>[...]</TOOLCALL>, got {text[:200]!r}")
    value = json.loads(text[len(start):-len(end)])
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError("the tool call is not a non-empty JSON list")
    calls = []
    for c in value:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise ValueError(f"a tool call without a string name: {json.dumps(c)[:200]}")
        args = c.get("arguments", {})
        if isinstance(args, str):
            json.loads(args)  # must itself be JSON
        else:
            args = json.dumps(args, ensure_ascii=False)
        calls.append((c["name"], args))
    return calls


class FrameDecoder:
    """Per call: FrameEvents in order -> FrameOutputs."""

    def __init__(self, tokenizer, rnnt_vocab, tokens, ids: EventIds, max_tool_call_tokens: int):
        self.tokens = tokens
        self.skip = tokenizer.display_skip_ids
        self.tool_start = tokenizer.token_to_id(tokens.tool_call_start)
        self.tool_end = tokenizer.token_to_id(tokens.tool_call_end)
        self.text = IncrementalText(tokenizer.decode)
        self.user = IncrementalText(rnnt_vocab.decode) if rnnt_vocab is not None else None
        self.tokenizer, self.ids, self.max_tool = tokenizer, ids, max_tool_call_tokens
        self.collecting: list[int] | None = None

    def __call__(self, ev: FrameEvent) -> FrameOutputs:
        t = self.tokens
        out = FrameOutputs(ev.frame, ev.pcm16, "", ev.text == t.bos_id, ev.text == t.eos_id, "",
                           lag_s=max(0.0, ev.sent_at - ev.ready_at))
        if out.turn_start or out.turn_end:   # a turn's text is decoded on its own (LANDSCAPE 2.2/2.3)
            self.text.reset()
        elif ev.text not in self.skip:
            out.text_delta = self.text.add([ev.text])
        if self.user is not None and ev.user:
            out.user_delta = self.user.add(list(ev.user))
        self._function_channel(ev, out)
        return out

    def _function_channel(self, ev: FrameEvent, out: FrameOutputs) -> None:
        f = ev.func
        if f == self.tool_start and self.tool_start is not None:
            self.collecting = []
        elif self.collecting is None:
            return
        elif f == self.tool_end:
            ids, self.collecting = self.collecting, None
            text = self.tokenizer.decode(ids)
            try:
                for name, args in parse_tool_calls(text):
                    out.tool_calls.append(ToolCall(self.ids.next("call"), self.ids.next("item"), name, args,
                                                   ev.frame))
            except ValueError as e:
                out.tool_errors.append(f"could not parse the model's tool call ({e}): {text[:300]!r}")
        elif f not in self.skip:   # PAD between call tokens carries nothing
            self.collecting.append(f)
            if len(self.collecting) > self.max_tool:
                self.collecting = None
                out.tool_errors.append(f"tool call longer than serve.max_tool_call_tokens = {self.max_tool} "
                                       f"tokens; dropped")


def render_tool_prompt(instructions: str | None, tools: list[dict]) -> str | None:
    """System prompt with the tools advertised (spec 3.9): instructions, the tool list in an
    <AVAILABLE_TOOLS> block (JSON with sorted keys, as the training template's tojson), how to call, and
    each tool's on-hold message. The on-hold message reaches the model only through this prompt: the
    model speaks on its text channel, so the server cannot put words in its mouth; it can only ask."""
    if not tools:
        return instructions
    listed = []
    for t in tools:
        entry = {"name": t["name"], "description": t.get("description", ""),
                 "parameters": t.get("parameters", {"type": "object", "properties": {}})}
        if t.get("on_hold_message"):
            entry["on_hold_message"] = t["on_hold_message"]
        listed.append(entry)
    parts = [instructions.strip()] if instructions else []
    parts.append("You can use the following tools to assist the user if required: <AVAILABLE_TOOLS>"
                 + json.dumps(listed, sort_keys=True, ensure_ascii=False) + "</AVAILABLE_TOOLS>")
    parts.append('To use a tool, write <TOOLCALL>[{"name": <tool name>, "arguments": <arguments object>}]'
                 "</TOOLCALL>. The result comes back as <TOOL_RESPONSE>[<result>]</TOOL_RESPONSE>.")
    holds = [f'While {t["name"]} runs, say: "{t["on_hold_message"]}"' for t in tools if t.get("on_hold_message")]
    if holds:
        parts.append(" ".join(holds))
    return " ".join(parts)


def tool_response_ids(tokenizer, output: str, limit: int) -> list[int]:
    """The tokens of `<TOOL_RESPONSE>[<json value>]</TOOL_RESPONSE>` (spec 3.9), forced one per frame on
    the function channel. `output` is used as JSON when it parses, else as a JSON string. A result that
    would tokenise to a special token (e.g. a literal "<SPECIAL_20>") is refused: it would be read as
    channel control."""
    try:
        value = json.loads(output)
    except ValueError:
        value = output
    text = "<TOOL_RESPONSE>[" + json.dumps(value, ensure_ascii=False) + "]</TOOL_RESPONSE>"
    ids = tokenizer.encode(text)
    if any(i in tokenizer.display_skip_ids for i in ids):
        raise Refusal("invalid_tool_output", "the tool output contains a special token string "
                      "(e.g. <s>, </s> or <SPECIAL_n>)")
    if len(ids) > limit:
        raise Refusal("tool_output_too_long", f"the tool output is {len(ids)} tokens; the limit is "
                      f"serve.max_tool_output_tokens = {limit}")
    return ids


# =====================================================================================================
# One call: the bridge between the engine thread and a connection
# =====================================================================================================
@dataclass
class Fatal:
    """The last thing a connection gets: an error, then the socket closes."""
    code: str
    message: str


class Handover:
    """Engine thread -> event loop with one wake-up per burst: a step hands out one event per call, and
    a `call_soon_threadsafe` each (a lock and a write to the loop's wake-up pipe) cost the engine thread
    ~1 ms per step at 128 calls and woke the loop 128 times. Events keep their order (one FIFO)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._queue: deque = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def put(self, bridge: "CallBridge", ev) -> None:   # engine thread
        self._queue.append((bridge, ev))
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:   # the loop is gone (server shutting down)
            pass

    def _drain(self) -> None:   # event loop
        with self._lock:
            self._scheduled = False   # a put from now on schedules another drain
        while self._queue:
            bridge, ev = self._queue.popleft()
            bridge._on_event(ev)


class CallBridge:
    """A connection's place on the server: its engine call (opened on the first audio), its bounded
    outbox, its tool ledger. Methods run on the event loop, except `_from_engine`."""

    def __init__(self, server: "Server", call_id: str):
        self.server, self.id = server, call_id
        self.loop = asyncio.get_running_loop()
        self.handover = server.handover(self.loop)
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
        self.transport = None

    # -- engine side
    def open(self, options: CallOptions) -> None:
        try:
            self.call = self.server.engine.open_call(options, self._from_engine, self.id)
        except EngineBusy as e:
            raise Refusal(e.code, str(e), 503) from None

    def _from_engine(self, ev) -> None:   # engine thread: hand over, never block
        self.handover.put(self, ev)

    def _on_event(self, ev) -> None:
        if isinstance(ev, EndedEvent):
            self.engine_ended = True
            self.server.metrics.call_ended(ev.reason)
            if self.socket_done:
                self.server.forget(self)
            elif self.transport is not None and self._cut is None:
                # The call is over; its socket must follow. A client that stopped reading would keep the
                # writer waiting on the send buffer for ever, and its server place with it: cut once a
                # client reading at playback rate would have had everything still queued.
                queued_s = self.frames_waiting * self.server.mcfg.frame_length
                self._cut = self.loop.call_later(self.server.cfg.slow_consumer_grace_s + queued_s,
                                                 self._cut_if_stuck)
        if self.failed is not None:
            return
        if isinstance(ev, FrameEvent):
            self.frames_seen = ev.frame + 1
            self._inject_due()
            if self.frames_waiting >= self.server.cfg.max_outbound_frames:
                self.fail("slow_consumer", f"the client fell {self.frames_waiting} frames behind; the limit is "
                          f"serve.max_outbound_frames = {self.server.cfg.max_outbound_frames}")
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
        self.server.metrics.refusal(code)
        if self.call is not None and not self.engine_ended:
            self.call.abort(code, message)
        self.outbox.clear()
        self.frames_waiting = 0
        self.outbox.append(Fatal(code, message))
        self.failed = self.outbox[-1]
        self._wake.set()
        if self.transport is not None:
            if self._cut is not None:
                self._cut.cancel()
            self._cut = self.loop.call_later(self.server.cfg.slow_consumer_grace_s, self._cut_if_stuck)

    def _cut_if_stuck(self) -> None:
        """The socket outlived its grace after the error or the call's end: drop the connection. Whether
        the writer is still behind queued output or has taken the error, a client that does not read
        keeps it waiting (on the send buffer's drain: for ever; or in aiohttp's close for a reply that
        never comes: 10 s. tests/test_server.py::test_slow_consumer_ends_only_its_call failed 1 run in 6
        while this waited only for a writer that had not taken the error). A client that reads has
        closed long before."""
        if not self.socket_done and self.transport is not None:
            self.transport.abort()

    def hang_up(self) -> None:
        """The connection is gone: end the call (if any) and release the place once the engine agrees."""
        self.socket_done = True
        if self._cut is not None:
            self._cut.cancel()
        if self.call is not None and not self.engine_ended:
            self.call.abort("hangup", "the client disconnected")
        if self.call is None or self.engine_ended:
            self.server.forget(self)

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
        ids = tool_response_ids(self.server.tokenizer, output, self.server.cfg.max_tool_output_tokens)
        self.tools_answered.add(call_id)
        due = self.tool_calls[call_id].frame + 1 + self.server.cfg.tool_on_hold_min_frames
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


# =====================================================================================================
# The server
# =====================================================================================================
class Server:
    def __init__(self, engine, tokenizer, rnnt_vocab, cfg: ServeConfig | None = None, model_name: str = "",
                 voices: list[str] | None = None, default_voice: str | None = None,
                 session_defaults: SessionSettings | None = None):
        self.engine, self.tokenizer, self.rnnt_vocab = engine, tokenizer, rnnt_vocab
        self.cfg = cfg or ServeConfig()
        # the places, the longest call and the input budget are the engine's: one setting each
        self.max_calls, self.max_call_s = engine.cfg.max_calls, engine.cfg.max_call_s
        self.max_pending_s = engine.cfg.max_pending_s
        mc = engine.model.cfg
        self.mcfg = mc
        self.model_name = model_name or mc.name
        self.voices = voices or [mc.talker.speaker]
        self.default_voice = default_voice or mc.talker.speaker
        # what a call gets for the settings its session does not give (seed, text sampling: scripts/serve.py's
        # `seed` and `sampling`)
        self.session_defaults = session_defaults or SessionSettings()
        self.in_rate, self.out_rate = mc.source_sample_rate, mc.target_sample_rate
        self.sessions: dict[str, CallBridge] = {}
        self.metrics = ServerMetrics(self.cfg.deadline_ms / 1000.0)
        self.ready = False
        self._sampler: asyncio.Task | None = None
        self._starting: asyncio.Task | None = None
        self._handover: Handover | None = None

    def handover(self, loop: asyncio.AbstractEventLoop) -> Handover:
        """The loop's engine-event hand-over (one per event loop, shared by its calls)."""
        if self._handover is None or self._handover.loop is not loop:
            self._handover = Handover(loop)
        return self._handover

    # -- places
    def reserve(self, call_id: str | None) -> CallBridge:
        call_id = call_id or uuid.uuid4().hex[:16]
        if call_id in self.sessions:
            self.metrics.refusal("call_id_in_use")
            raise Refusal("call_id_in_use", f"call id {call_id!r} belongs to a live call", 409)
        if not self.ready:
            self.metrics.refusal("not_ready")
            raise Refusal("not_ready", "the server is still warming up; see GET /health", 503)
        if len(self.sessions) >= self.max_calls:
            self.metrics.refusal("busy")
            raise Refusal("busy", f"all {self.max_calls} call places are taken (engine.max_calls); "
                          f"try again later", 503)
        bridge = CallBridge(self, call_id)
        self.sessions[call_id] = bridge
        return bridge

    def forget(self, bridge: CallBridge) -> None:
        if self.sessions.get(bridge.id) is bridge:
            del self.sessions[bridge.id]

    def capabilities(self) -> dict:
        c = self.cfg
        return {"implementation_level": "model_native_duplex", "chunk_period_ms": 80,
                "input_frame_samples": self.mcfg.samples_per_frame_in,
                "output_frame_samples": self.mcfg.samples_per_frame_out,
                "turn_detection": "model_native", "supports_barge_in": False, "supports_tools": True,
                "supports_on_hold_message": True, "end_of_input": "input_audio_buffer.commit {final: true}",
                "voices": self.voices, "max_call_s": self.max_call_s, "max_pending_s": self.max_pending_s,
                "max_tools": c.max_tools, "max_outbound_frames": c.max_outbound_frames}

    def check_voice(self, voice: str | None) -> None:
        if voice is not None and voice not in self.voices:
            raise ProtocolError("unknown_voice", f"voice {voice!r}: this checkpoint has {self.voices}", "voice")

    def check_prompt(self, settings: SessionSettings) -> None:
        """The system prompt (instructions + tools) within engine.max_prompt_tokens, checked when it is set
        (Engine.prompt_ids, which admission asks again once the call's audio starts)."""
        try:
            self.engine.prompt_ids(render_tool_prompt(settings.instructions, settings.tools))
        except PromptTooLong as e:
            raise ProtocolError(e.code, f"{e} (instructions and tools)", "instructions") from None

    def _socket_setup(self, request: web.Request, bridge: CallBridge) -> None:
        bridge.transport = request.transport
        if self.cfg.send_buffer_kb and request.transport is not None:
            sock = request.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.cfg.send_buffer_kb * 1024)

    def limit_message(self, ev: EndedEvent) -> Fatal | None:
        """An engine end reason -> the error the client gets (None for a normal end)."""
        if ev.reason == "limit":
            return Fatal("call_too_long", f"the call reached engine.max_call_s = {self.max_call_s:g} s")
        if ev.reason == "error":
            return Fatal("engine_error", ev.message or "the engine failed this call")
        if ev.reason == "shutdown":
            return Fatal("server_shutdown", "the server is shutting down")
        return None

    # -- lifecycle
    async def on_startup(self, app: web.Application) -> None:
        # Capture and warm-up run in the background: the port answers at once, /health says 503 until done.
        self._starting = asyncio.create_task(self._start_engine())
        self._sampler = asyncio.create_task(self._sample_metrics())

    async def _start_engine(self) -> None:
        try:
            if not self.engine._running:   # graph capture happens here: on a worker thread, not on the loop
                await asyncio.get_running_loop().run_in_executor(None, self.engine.start)
            await self.warm_up()
        except Exception:
            log.exception("engine start-up failed; /health stays 503")
            raise

    async def on_cleanup(self, app: web.Application) -> None:
        for task in (self._sampler, self._starting):
            if task is not None:
                task.cancel()
        self.ready = False
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)

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
            call.append(np.zeros(self.cfg.warmup_frames * self.mcfg.samples_per_frame_in, dtype=np.float32))
            call.end_input()
            ev = await done
            if ev.reason != "completed":
                raise RuntimeError(f"warm-up call ended with {ev.reason}: {ev.message}")
        # Everything alive now (the model's modules and parameters, the captured graphs' bookkeeping)
        # lives as long as the server: moved out of the cyclic GC's reach, a full collection while serving
        # scans only what calls create. Why: one step's event hand-over stalled 41 ms under 128 calls in
        # session 5's load run, and a full collection over the start-up objects is a pause of that kind
        # (sglang freezes after its graph capture for the same reason). Not yet measured on its own.
        gc.collect()
        gc.freeze()
        self.ready = True
        self.metrics.ready.set(1)

    async def _sample_metrics(self) -> None:
        while True:
            self.metrics.sample_engine(self.engine, len(self.sessions))
            await asyncio.sleep(1.0)

    def healthy(self) -> bool:
        t = self.engine._thread
        return self.ready and getattr(self.engine, "ready", True) and t is not None and t.is_alive()

    # -- routes
    def app(self) -> web.Application:
        app = web.Application(client_max_size=int(self.cfg.max_upload_mb * 2 ** 20) + 65536)
        app.router.add_get("/v1/realtime", self.realtime)
        app.router.add_get("/generate/ws", self.generate_ws)
        app.router.add_post("/generate", self.generate_post)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        static = Path(self.cfg.static_dir) if self.cfg.static_dir else STATIC

        async def index(request: web.Request) -> web.FileResponse:
            return web.FileResponse(static / "index.html")

        app.router.add_get("/", index)
        app.router.add_static("/static/", static)
        app.on_startup.append(self.on_startup)
        app.on_cleanup.append(self.on_cleanup)
        return app

    async def health(self, request: web.Request) -> web.Response:
        ok = self.healthy()
        body = {"status": "ready" if ok else ("starting" if not self.ready else "engine_down"),
                "active_calls": self.engine.active_calls, "sessions": len(self.sessions),
                "max_calls": self.max_calls}
        return web.json_response(body, status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        self.metrics.sample_engine(self.engine, len(self.sessions))
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})

    def _websocket(self) -> web.WebSocketResponse:
        # compress=False: per-message deflate is off (PCM barely compresses; it would only cost CPU)
        return web.WebSocketResponse(compress=False, max_msg_size=self.cfg.max_message_kb * 1024)

    async def _refuse_ws(self, request, ws, refusal: Refusal, realtime: bool) -> web.WebSocketResponse:
        if refusal.code not in ("busy", "call_id_in_use", "not_ready"):   # reserve() counted those
            self.metrics.refusal(refusal.code)
        body = (error_event(f"event_refused_{uuid.uuid4().hex[:8]}", refusal.code, refusal.message) if realtime
                else {"type": "error", "code": refusal.code, "message": refusal.message, "status": refusal.status})
        await ws.send_str(json.dumps(body))
        await ws.close(code=1013 if refusal.code == "busy" else 1008, message=refusal.code.encode())
        return ws

    # ---------------------------------------------------------------------------------------------
    # WS /v1/realtime
    # ---------------------------------------------------------------------------------------------
    async def realtime(self, request: web.Request) -> web.StreamResponse:
        call_id = request.query.get("call_id")
        if call_id and call_id in self.sessions:   # before the upgrade: a plain 409
            self.metrics.refusal("call_id_in_use")
            return web.json_response({"error": {"type": "invalid_request_error", "code": "call_id_in_use",
                                                "message": f"call id {call_id!r} belongs to a live call"}},
                                     status=409)
        ws = self._websocket()
        await ws.prepare(request)
        try:
            bridge = self.reserve(call_id)
        except Refusal as r:
            return await self._refuse_ws(request, ws, r, realtime=True)
        self._socket_setup(request, bridge)
        session = RealtimeSession(self, ws, bridge)
        try:
            await session.run()
        finally:
            bridge.hang_up()
        return ws

    # ---------------------------------------------------------------------------------------------
    # WS /generate/ws (native)
    # ---------------------------------------------------------------------------------------------
    async def generate_ws(self, request: web.Request) -> web.StreamResponse:
        call_id = request.query.get("call_id")
        if call_id and call_id in self.sessions:
            self.metrics.refusal("call_id_in_use")
            return web.json_response({"type": "error", "code": "call_id_in_use",
                                      "message": f"call id {call_id!r} belongs to a live call"}, status=409)
        ws = self._websocket()
        await ws.prepare(request)
        try:
            first = await ws.receive(timeout=self.cfg.idle_timeout_s)
        except asyncio.TimeoutError:
            return await self._refuse_ws(request, ws, Refusal("idle_timeout", "no opening message within "
                                                              f"serve.idle_timeout_s = {self.cfg.idle_timeout_s:g} s"),
                                         realtime=False)
        if first.type != WSMsgType.TEXT:
            if first.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                return ws
            return await self._refuse_ws(request, ws, Refusal("invalid_event", "the first message must be the "
                                                              "JSON opening message"), realtime=False)
        try:
            opening = parse_client_event(first.data)
            settings, voice, call_id = self._native_opening(opening, call_id)
            bridge = self.reserve(call_id)
        except ProtocolError as e:
            return await self._refuse_ws(request, ws, Refusal(e.code, e.message), realtime=False)
        except Refusal as r:
            return await self._refuse_ws(request, ws, r, realtime=False)
        self._socket_setup(request, bridge)
        try:
            bridge.open(call_options(settings, voice))
        except Refusal as r:
            bridge.hang_up()
            return await self._refuse_ws(request, ws, r, realtime=False)
        session = NativeSession(self, bridge, settings, tokens=opening.get("tokens") is True)
        try:
            await session.run_ws(ws)
        finally:
            bridge.hang_up()
        return ws

    def _native_opening(self, ev: dict, call_id: str | None):
        """The opening message of /generate/ws and the form fields of POST /generate."""
        if ev.get("type", "start") != "start":
            raise ProtocolError("invalid_event", f"the opening message must have type 'start', got {ev['type']!r}",
                                "type")
        for name, want in (("sample_rate", self.in_rate), ("channels", 1), ("sample_width", 2)):
            if name in ev and ev[name] != want:
                raise ProtocolError("invalid_audio_format", f"{name} {ev[name]}: this model takes {want} "
                                    f"(16 kHz mono 16-bit PCM; audio is never resampled)", name)
        if "format" in ev and ev["format"] not in ("pcm16", "pcm_s16le"):
            raise ProtocolError("invalid_audio_format", f"format {ev['format']!r}: only 'pcm16'", "format")
        session = {k: ev[k] for k in ("instructions", "tools", "seed", "temperature", "top_p",
                                      "repetition_penalty", "voice") if k in ev}
        if "prompt" in ev:
            session["instructions"] = ev["prompt"]
        settings = parse_session(session, copy.deepcopy(self.session_defaults), self.in_rate, self.out_rate, self.cfg.max_tools)
        self.check_voice(settings.voice)
        self.check_prompt(settings)
        cid = field_of(ev, "call_id", str, "start") or call_id
        return settings, settings.voice, cid

    # ---------------------------------------------------------------------------------------------
    # POST /generate
    # ---------------------------------------------------------------------------------------------
    async def generate_post(self, request: web.Request) -> web.StreamResponse:
        try:
            fields, wav = await self._read_upload(request)
            opening = {"type": "start", **fields}
            settings, voice, call_id = self._native_opening(opening, request.query.get("call_id"))
            info = wav_info(wav)
            if info.sample_rate == self.in_rate and info.seconds > self.cfg.max_upload_s:
                raise Refusal("upload_too_long", f"{info.seconds:.1f} s of audio; the limit is "
                              f"serve.max_upload_s = {self.cfg.max_upload_s:g} s", 413)
            if info.sample_rate == self.in_rate and info.seconds > self.max_call_s:
                raise Refusal("call_too_long", f"{info.seconds:.1f} s of audio; the limit is "
                              f"engine.max_call_s = {self.max_call_s:g} s", 413)
            pcm = decode_wav(wav, self.in_rate)
            bridge = self.reserve(call_id)
        except AudioFormatError as e:
            self.metrics.refusal("invalid_audio_format")
            return web.json_response({"type": "error", "code": "invalid_audio_format", "message": str(e)},
                                     status=400)
        except ProtocolError as e:
            self.metrics.refusal(e.code)
            return web.json_response({"type": "error", "code": e.code, "message": e.message, "param": e.param},
                                     status=400)
        except Refusal as r:
            if r.code not in ("busy", "call_id_in_use", "not_ready"):
                self.metrics.refusal(r.code)
            return web.json_response({"type": "error", "code": r.code, "message": r.message}, status=r.status)
        self._socket_setup(request, bridge)
        try:
            bridge.open(call_options(settings, voice))
        except Refusal as r:
            bridge.hang_up()
            return web.json_response({"type": "error", "code": r.code, "message": r.message}, status=r.status)
        session = NativeSession(self, bridge, settings, tokens=opening.get("tokens") in (True, "1", "true"))
        try:
            return await session.run_upload(request, pcm)
        finally:
            bridge.hang_up()

    async def _read_upload(self, request: web.Request) -> tuple[dict, bytes]:
        """-> (form fields, WAV bytes). Raw body (audio/wav) with settings in the query string, or
        multipart/form-data with a file field `audio` (or `file`) and settings as fields."""
        limit = int(self.cfg.max_upload_mb * 2 ** 20)
        too_large = Refusal("upload_too_large", f"the upload is larger than serve.max_upload_mb = "
                            f"{self.cfg.max_upload_mb:g} MiB", 413)
        if request.content_length is not None and request.content_length > limit + 65536:
            raise too_large
        fields: dict = {}
        for k, v in request.query.items():
            fields[k] = v
        wav = None
        if request.content_type.startswith("multipart/"):
            try:
                reader = await request.multipart()
                async for part in reader:
                    data = await self._read_capped(part, limit, too_large)
                    if part.name in ("audio", "file"):
                        wav = data
                    elif part.name:
                        fields[part.name] = data.decode("utf-8", errors="replace")
            except (ValueError, AssertionError) as e:   # aiohttp's multipart reader on a body it cannot parse
                raise Refusal("invalid_upload", f"the multipart/form-data body does not parse: {e}", 400) from None
        else:
            wav = await self._read_capped(request.content, limit, too_large)
        if not wav:
            raise Refusal("invalid_audio_format", "no WAV in the request (raw body, or a multipart field 'audio')")
        return _typed_fields(fields), wav

    @staticmethod
    async def _read_capped(stream, limit: int, too_large: Refusal) -> bytes:
        chunks, n = [], 0
        read = getattr(stream, "read_chunk", None) or stream.read   # multipart part | request body
        while True:
            chunk = await read(65536)
            if not chunk:
                return b"".join(chunks)
            n += len(chunk)
            if n > limit:
                raise too_large
            chunks.append(chunk)


def _typed_fields(fields: dict) -> dict:
    """Form/query strings -> the JSON types the opening message uses."""
    out = {}
    for k, v in fields.items():
        if k in ("seed", "sample_rate", "channels", "sample_width"):
            try:
                v = int(v)
            except ValueError:
                raise ProtocolError("invalid_event", f"{k} must be an integer", k) from None
        elif k in ("temperature", "top_p", "repetition_penalty"):
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


# =====================================================================================================
# Sessions: one per connection, per protocol
# =====================================================================================================
class RealtimeSession:
    """The OpenAI Realtime dialect over one WebSocket."""

    def __init__(self, server: Server, ws: web.WebSocketResponse, bridge: CallBridge):
        self.server, self.ws, self.bridge = server, ws, bridge
        self.socket = DuplexSocket(ws)
        self.settings = copy.deepcopy(server.session_defaults)
        self.out = RealtimeOutput(bridge.ids)
        self.decoder: FrameDecoder | None = None

    def session_body(self) -> dict:
        s = self.server
        return session_object(self.bridge.id, s.model_name, self.settings, self.settings.voice or s.default_voice,
                              s.capabilities(), s.in_rate, s.out_rate)

    async def run(self) -> None:
        self.bridge.push(self.out.ev("session.created", session=self.session_body()))
        await self.socket.run(self._read, self._write)

    async def _read(self) -> None:
        s, b = self.server, self.bridge
        while True:
            input_open = b.call is None or not b.call.input_ended
            try:
                msg = await self.ws.receive(timeout=s.cfg.idle_timeout_s if input_open else None)
            except asyncio.TimeoutError:
                b.fail("idle_timeout", f"nothing received for serve.idle_timeout_s = {s.cfg.idle_timeout_s:g} s")
                await self._wait_closed()
                return
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                return
            if b.failed is not None:
                continue
            client_event_id = None
            try:
                if msg.type == WSMsgType.BINARY:
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

    async def _wait_closed(self) -> None:
        """After a fatal error: keep reading until the writer closes the socket (or the client does)."""
        while True:
            msg = await self.ws.receive()
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                return

    def _handle(self, ev: dict) -> None:
        s, b, kind = self.server, self.bridge, ev["type"]
        if kind == "input_audio_buffer.append":
            for name in ("sample_rate", "sample_rate_hz"):
                if name in ev and ev[name] != s.in_rate:
                    raise ProtocolError("invalid_audio_format", f"{name} {ev[name]} Hz: this model takes "
                                        f"{s.in_rate} Hz (audio is never resampled)", name)
            data = decode_audio(ev.get("audio"), "audio")
            self._ensure_call()
            b.append_pcm16(data)
        elif kind == "session.update":
            if b.call is not None:
                raise ProtocolError("session_locked", "session settings are fixed once audio has started "
                                    "(the system prompt is already in the model)", "session")
            new = parse_session(ev.get("session"), self.settings, s.in_rate, s.out_rate, s.cfg.max_tools)
            s.check_voice(new.voice)
            s.check_prompt(new)
            call_options(new, new.voice)   # validates the sampling values
            self.settings = new
            b.push(self.out.ev("session.updated", session=self.session_body()))
        elif kind == "input_audio_buffer.commit":
            final = any(ev.get(k) is True for k in ("final", "end_of_input", "pad_partial"))
            if final and b.call is not None and b.call.input_ended:
                raise Refusal("append_after_end", "input already ended")
            for e in self.out.commit():
                b.push(e)
            if final:
                self._ensure_call()
                b.call.end_input()
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
        b, s = self.bridge, self.server
        if b.call is None:
            b.open(call_options(self.settings, self.settings.voice))
            self.decoder = FrameDecoder(s.tokenizer, s.rnnt_vocab, s.mcfg.tokens, b.ids, s.cfg.max_tool_call_tokens)

    async def _write(self) -> None:
        s, b, ws = self.server, self.bridge, self.ws
        while True:
            item = await b.next()
            if isinstance(item, Fatal):
                if item.code:
                    for e in self.out.close("failed", None):
                        await ws.send_str(json.dumps(e))
                    await ws.send_str(json.dumps(error_event(b.ids.next("event"), item.code, item.message)))
                await self.socket.close(1000 if not item.code else 1008, (item.code or "closed").encode())
                return
            if isinstance(item, dict):
                await ws.send_str(json.dumps(item))
            elif isinstance(item, FrameEvent):
                out = self.decoder(item)
                for t in out.tool_calls:
                    b.tool_calls[t.call_id] = t
                for e in self.out.frame(out):
                    await ws.send_str(json.dumps(e))
                s.metrics.frame_sent(time.monotonic() - item.ready_at)
            elif isinstance(item, DrainedEvent):
                await ws.send_str(json.dumps(self.out.ev("input_audio_buffer.drained", frames=item.frames)))
            elif isinstance(item, EndedEvent):
                fatal = s.limit_message(item)
                if fatal is not None:
                    s.metrics.refusal(fatal.code)
                    for e in self.out.close("incomplete", None):
                        await ws.send_str(json.dumps(e))
                    await ws.send_str(json.dumps(error_event(b.ids.next("event"), fatal.code, fatal.message)))
                    await self.socket.close(1008, fatal.code.encode())
                    return
                for e in self.out.close("completed"):
                    await ws.send_str(json.dumps(e))
                await ws.send_str(json.dumps(self.out.ev("session.closed", reason=item.reason)))
                await self.socket.close(1000, b"completed")
                return


class DuplexSocket:
    """One WebSocket served by two tasks: a reader (client messages) and a writer (engine output), the
    writer being the one that ends the socket.

    The writer closes through `close`, which stops the reader first. aiohttp's close() reads the client's
    close reply itself, discarding what the client still sends, but only if no other task is waiting in
    receive(); with the reader waiting it hands that task a CLOSING message and closes the transport
    without the reply. A client still sending audio then got a TCP reset, which discards the bytes it had
    not read yet: the error just sent and the close frame (the client saw 1006 and no error;
    tests/test_server.py::test_input_budget_exceeded failed 11 runs in 40 with two CPU-bound processes
    beside it, 0 in 40 after this change)."""

    def __init__(self, ws: web.WebSocketResponse):
        self.ws = ws
        self.reader: asyncio.Task | None = None
        self.closing = False

    async def run(self, read, write) -> None:
        """Until both end. The reader ending first (the client closed or vanished) cancels the writer,
        which may be waiting for output; the writer closing the socket cancels the reader."""
        self.reader = asyncio.create_task(read())
        writer = asyncio.create_task(write())
        try:
            try:
                await self.reader
            except asyncio.CancelledError:
                if not self.closing or asyncio.current_task().cancelling():
                    raise  # this task itself was cancelled, not the reader by close()
        finally:
            if not writer.done() and not self.closing:
                writer.cancel()
            try:
                await writer
            except (asyncio.CancelledError, ConnectionError):
                pass

    async def close(self, code: int, message: bytes) -> None:
        self.closing = True
        if self.reader is not None and not self.reader.done():
            self.reader.cancel()
            try:
                await self.reader
            except asyncio.CancelledError:
                pass
        await self.ws.close(code=code, message=message)


# Refusals that end the call (the others are reported and the call goes on).
FATAL_CODES = {"busy", "input_budget_exceeded", "not_ready"}


class NativeSession:
    """The native protocol: /generate/ws (binary PCM both ways) and POST /generate (NDJSON)."""

    HEADER = struct.Struct("<If")   # frame index, engine lag in ms; then the PCM16 samples

    def __init__(self, server: Server, bridge: CallBridge, settings: SessionSettings, tokens: bool = False):
        self.server, self.bridge = server, bridge
        self.tokens = tokens   # opening {"tokens": true}: also send each frame's raw token ids
        self.decoder = FrameDecoder(server.tokenizer, server.rnnt_vocab, server.mcfg.tokens, bridge.ids,
                                    server.cfg.max_tool_call_tokens)

    def started(self) -> dict:
        s, m = self.server, self.server.mcfg
        return {"type": "started", "call_id": self.bridge.id,
                "input": {"format": "pcm16", "sample_rate": s.in_rate, "channels": 1,
                          "frame_samples": m.samples_per_frame_in},
                "output": {"format": "pcm16", "sample_rate": s.out_rate, "channels": 1,
                           "frame_samples": m.samples_per_frame_out, "header": "<If: frame, lag_ms"},
                "limits": {"max_call_s": s.max_call_s, "max_pending_s": s.max_pending_s,
                           "max_outbound_frames": s.cfg.max_outbound_frames}}

    def events(self, item) -> tuple[FrameOutputs | None, list[dict], Fatal | None, bool]:
        """An outbox item -> (frame outputs, JSON events, fatal error, call over)."""
        s, b = self.server, self.bridge
        if isinstance(item, Fatal):
            return None, [], item, True
        if isinstance(item, dict):
            return None, [item], None, False
        if isinstance(item, FrameEvent):
            out = self.decoder(item)
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
                b.tool_calls[t.call_id] = t
                evs.append({"type": "function_call", "frame": k, "call_id": t.call_id, "name": t.name,
                            "arguments": t.arguments})
            for m in out.tool_errors:
                s.metrics.refusal("function_call_parse_error")
                evs.append({"type": "error", "frame": k, "code": "function_call_parse_error", "message": m})
            # the lag the client gets in the header is /metrics' frame lag: input received -> packet sent
            out.lag_s = time.monotonic() - item.ready_at
            s.metrics.frame_sent(out.lag_s)
            return out, evs, None, False
        if isinstance(item, DrainedEvent):
            return None, [{"type": "drained", "frames": item.frames}], None, False
        if isinstance(item, EndedEvent):
            fatal = s.limit_message(item)
            if fatal is not None:
                s.metrics.refusal(fatal.code)
                return None, [], fatal, True
            return None, [{"type": "ended", "reason": item.reason}], None, True
        raise TypeError(item)

    # -- /generate/ws
    async def run_ws(self, ws: web.WebSocketResponse) -> None:
        self.bridge.push(self.started())
        self.socket = DuplexSocket(ws)
        await self.socket.run(lambda: self._read_ws(ws), lambda: self._write_ws(ws))

    async def _read_ws(self, ws) -> None:
        s, b = self.server, self.bridge
        while True:
            try:
                msg = await ws.receive(timeout=s.cfg.idle_timeout_s if not b.call.input_ended else None)
            except asyncio.TimeoutError:
                b.fail("idle_timeout", f"nothing received for serve.idle_timeout_s = {s.cfg.idle_timeout_s:g} s")
                continue
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                return
            if b.failed is not None:
                continue
            try:
                if msg.type == WSMsgType.BINARY:
                    b.append_pcm16(msg.data)
                    continue
                ev = parse_client_event(msg.data)
                kind = ev["type"]
                if kind == "end_input":
                    b.call.end_input()
                elif kind == "tool_output":
                    b.tool_output(ev.get("call_id"), ev.get("output", ""))
                elif kind == "abort":   # -> EndedEvent(aborted) -> {"type": "ended", "reason": "aborted"}
                    b.call.abort("aborted", "the client aborted the call")
                elif kind == "start":
                    raise ProtocolError("invalid_event", "the call has already started", "type")
                else:
                    raise ProtocolError("unknown_event", f"unknown event type {kind!r}", "type")
            except ProtocolError as e:
                s.metrics.refusal(e.code)
                b.push({"type": "error", "code": e.code, "message": e.message, "param": e.param})
            except Refusal as r:
                if r.code in FATAL_CODES:
                    b.fail(r.code, r.message)
                else:
                    s.metrics.refusal(r.code)
                    b.push({"type": "error", "code": r.code, "message": r.message})

    async def _write_ws(self, ws) -> None:
        while True:
            item = await self.bridge.next()
            out, evs, fatal, over = self.events(item)
            if out is not None:
                await ws.send_bytes(self.HEADER.pack(out.frame, out.lag_s * 1000.0) + out.pcm16)
            for e in evs:
                await ws.send_str(json.dumps(e))
            if fatal is not None:
                await ws.send_str(json.dumps({"type": "error", "code": fatal.code, "message": fatal.message}))
                await self.socket.close(1008, fatal.code.encode())
                return
            if over:
                await self.socket.close(1000, b"completed")
                return

    # -- POST /generate
    async def run_upload(self, request: web.Request, pcm: np.ndarray) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache",
                                           "X-Call-Id": self.bridge.id})
        await resp.prepare(request)
        feeder = asyncio.create_task(self._feed(pcm))
        try:
            await resp.write((json.dumps(self.started()) + "\n").encode())
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
                    await resp.write("".join(json.dumps(e) + "\n" for e in lines).encode())
                if over:
                    break
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            feeder.cancel()
        return resp

    async def _feed(self, pcm: np.ndarray) -> None:
        """An upload enters the call as fast as the engine takes it, but never more than half the
        pending-input budget ahead (the budget protects the engine from live clients too)."""
        b, s = self.bridge, self.server
        n = s.mcfg.samples_per_frame_in
        ahead = max(1, int(s.max_pending_s / s.mcfg.frame_length) // 2)
        pos = 0
        while pos < pcm.size and b.failed is None and not b.engine_ended:
            room = ahead - b.call.pending_frames
            if room <= 0:
                await asyncio.sleep(s.mcfg.frame_length / 2)
                continue
            b.append(pcm[pos: pos + room * n])
            pos += room * n
        if b.failed is None and not b.engine_ended:
            b.call.end_input()
