"""What a connection's session and call need of the server: the engine, the vocabularies, the limits, the
metrics and the place registry, and the checks every protocol applies. The Server makes one; sessions
and bridges get it instead of the Server."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from nemo_duplex.server.errors import Fatal
from nemo_duplex.server.handover import Handover
from nemo_duplex.server.metrics import ServerMetrics
from nemo_duplex.server.realtime_protocol import ProtocolError, SessionSettings
from nemo_duplex.server.tools import render_tool_prompt
from nemo_duplex.serving.calls import EndedEvent, PromptTooLong
from nemo_duplex.settings import ServeConfig


@dataclass
class ServerContext:
    engine: object                 # serving.engine.Engine
    tokenizer: object
    rnnt_vocab: object | None
    cfg: ServeConfig
    metrics: ServerMetrics
    model_name: str
    voices: list[str]
    default_voice: str
    session_defaults: SessionSettings
    forget: Callable = field(repr=False)   # a bridge whose call is over gives its place back (Server.forget)

    def __post_init__(self):
        mc = self.engine.model.cfg
        self.tokens = mc.tokens
        self.frame_s = mc.frame_length
        self.in_rate, self.out_rate = mc.source_sample_rate, mc.target_sample_rate
        self.frame_in, self.frame_out = mc.samples_per_frame_in, mc.samples_per_frame_out
        # the places, the longest call and the input budget are the engine's: one setting each
        self.max_calls, self.max_call_s = self.engine.cfg.max_calls, self.engine.cfg.max_call_s
        self.max_pending_s = self.engine.cfg.max_pending_s

    def handover(self, loop: asyncio.AbstractEventLoop) -> Handover:
        """The loop's engine-event hand-over (one per event loop, shared by its calls)."""
        current = getattr(self, "_handover", None)
        if current is None or current.loop is not loop:
            self._handover = Handover(loop)
        return self._handover

    def capabilities(self) -> dict:
        c = self.cfg
        return {"implementation_level": "model_native_duplex", "chunk_period_ms": round(self.frame_s * 1000),
                "input_frame_samples": self.frame_in, "output_frame_samples": self.frame_out,
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

    def call_limit(self, settings: SessionSettings) -> float:
        """The call's longest input in seconds: its own max_call_s when it declared one, else the server's."""
        return settings.max_call_s if settings.max_call_s is not None else self.max_call_s

    def limit_message(self, ev: EndedEvent) -> Fatal | None:
        """An engine end reason -> the error the client gets (None for a normal end); a call that reached its
        limit is told which, the one it declared or the server's, by the engine's message (calls.limit_message)."""
        if ev.reason == "limit":
            return Fatal("call_too_long", ev.message or f"the call reached engine.max_call_s = {self.max_call_s:g} s")
        if ev.reason == "error":
            return Fatal("engine_error", ev.message or "the engine failed this call")
        if ev.reason == "shutdown":
            return Fatal("server_shutdown", "the server is shutting down")
        return None
