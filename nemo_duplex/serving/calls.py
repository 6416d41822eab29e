"""A call on the engine: what a client holds (`Call`), the options it opens with, the events it receives,
and the errors it can get. Methods on `Call` are thread safe and never wait on the GPU."""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from nemo_duplex.models.config import SamplingParams

if TYPE_CHECKING:
    from nemo_duplex.serving.engine import Engine


# ---- errors a client can get ------------------------------------------------------------------------
class EngineError(Exception):
    code = "engine_error"


class EngineBusy(EngineError):
    code = "busy"


class PromptTooLong(EngineError):
    code = "prompt_too_long"


class InputBudgetExceeded(EngineError):
    code = "input_budget_exceeded"


class CallLimitInvalid(EngineError):
    code = "invalid_max_call_s"


class CallClosed(EngineError):
    code = "call_closed"


class EngineDown(EngineBusy):
    """The engine stopped after a device error: no call can be served until the process restarts."""
    code = "engine_down"


def device_lost(e: BaseException) -> bool:
    """A CUDA error (a device-side assert, an illegal access) poisons the process's CUDA context: every
    later step would fail too, so the engine stops instead of failing each new call."""
    return isinstance(e, getattr(torch, "AcceleratorError", ())) or "CUDA error" in str(e)


def call_max_frames(options: "CallOptions", engine_max_call_s: float, frame_s: float) -> int:
    """The call's limit in frames: its own max_call_s, else the engine's; CallLimitInvalid outside (0, engine's]."""
    limit = engine_max_call_s if options.max_call_s is None else options.max_call_s
    if not 0 < limit <= engine_max_call_s:
        raise CallLimitInvalid(f"max_call_s = {limit!r}: a call's own limit is > 0 and at most "
                               f"engine.max_call_s = {engine_max_call_s:g} s")
    return math.ceil(limit / frame_s)


def limit_message(options: "CallOptions", engine_max_call_s: float) -> str:
    """Why a call at its limit ended (the "limit" EndedEvent's message, which the server passes on): the limit
    it declared, or the engine's."""
    own = options.max_call_s
    if own is not None:
        return (f"the call reached its own max_call_s = {own:g} s (the server's engine.max_call_s is "
                f"{engine_max_call_s:g} s)")
    return f"the call reached engine.max_call_s = {engine_max_call_s:g} s"


def system_prompt_ids(model, tokenizer, prompt: str | None, limit: int, longest_token: int) -> torch.Tensor | None:
    """The system prompt's ids (None for none), or PromptTooLong naming engine.max_prompt_tokens (`limit`). A
    prompt of more characters than the limit's tokens can cover (`longest_token`: the tokenizer's longest
    token, in characters) is refused without tokenizing it: a megabyte of instructions would hold the thread
    doing it (the server's event loop, or the engine's) for the tokenizer."""
    if prompt and len(prompt) > limit * longest_token:
        raise PromptTooLong(f"the system prompt is {len(prompt)} characters, more than "
                            f"engine.max_prompt_tokens = {limit} tokens can hold")
    ids = model.prompt_ids(tokenizer, prompt)
    if ids is not None and ids.numel() > limit:
        raise PromptTooLong(f"the system prompt is {ids.numel()} tokens; the limit is "
                            f"engine.max_prompt_tokens = {limit}")
    return ids


def forced_text(token: int) -> int:
    """A text token as a step's `forced` entry (frame_step: -1 none, >= 0 a function token, <= -2 text)."""
    return -2 - token


# ---- events -------------------------------------------------------------------------------------------
@dataclass
class CallOptions:
    prompt: str | None = None
    seed: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speaker: str | None = None
    # the call's own limit in seconds of input (None: engine.max_call_s; more than that is refused at
    # open_call). The call's KV pages are committed for this long (serving/pages.py), so a call that says it
    # is short leaves room for more calls.
    max_call_s: float | None = None


@dataclass
class FrameEvent:
    call_id: str
    frame: int
    text: int
    func: int
    pcm: np.ndarray          # [1764] float32 at 22.05 kHz
    user: list[int]          # RNN-T tokens of this frame
    top2: tuple[float, float]
    codes: np.ndarray        # [Q] int64
    ready_at: float          # monotonic time the frame's last input sample arrived
    sent_at: float           # monotonic time the engine handed the frame out
    pcm16: bytes             # pcm as little-endian int16 (audio.to_pcm16), made for the whole batch at once


@dataclass
class DrainedEvent:
    call_id: str
    frames: int


@dataclass
class EndedEvent:
    call_id: str
    reason: str              # completed | aborted | limit | error | shutdown
    message: str = ""


@dataclass
class InFlight:
    """A pipelined frame between its steps: what its halves so far gave, for its FrameEvent. Heard (two
    deep, its text half next): text, func and top2 still None."""
    frame: int
    ready_at: float
    stepped_at: float        # monotonic time its last step ended
    user: list[int]
    forced: int = -1         # the function token forced on its text half (-1: none)
    text: int | None = None
    func: int | None = None
    top2: tuple[float, float] | None = None


class Call:
    """A client's handle on one call. All methods are thread safe and never wait on the GPU."""

    def __init__(self, engine: "Engine", call_id: str, options: CallOptions, on_event: Callable):
        self.engine, self.id, self.options, self.on_event = engine, call_id, options, on_event
        self.slot: int | None = None
        self.max_frames = 0       # the call's limit in frames (Engine.open_call: its max_call_s or the engine's)
        self.prompt_tokens = 0    # its system prompt's length, known at admission
        self.kv_frames = 0        # frames its KV pages cover so far (serving/pages.py KVPages.before_step)
        self._lock = threading.Lock()
        self._buf = np.zeros(0, dtype=np.float32)   # received samples not yet cut into frames
        self._frames: deque[tuple[np.ndarray, float]] = deque()
        self._forced: deque[int] = deque()
        self.input_ended = False
        self.closed = False
        self.frames_in = 0        # whole frames received
        self.last_ready: float | None = None  # when the last whole frame arrived (engine.coalesce_ms)
        self.frames_out = 0       # frames handed out (FrameEvents)
        self.frames_stepped = 0   # frames a step has heard (frames_out, plus those in flight when pipelined)
        # engine.pipeline: the frames between their steps (Engine._step): heard, its text half next (two
        # deep); its text half done, its speech half next
        self.text_due: InFlight | None = None
        self.speech_due: InFlight | None = None
        self.admitted = False
        self.cohort = None        # engine.admission_thread: the calls admitted with it (admitter.Cohort)
        self.in_admission = False  # ... and while the thread admits it (its slot is the thread's)
        self.admission_submitted = 0.0   # when it was handed to the thread (engine.max_admission_s)
        self.opened_at = time.monotonic()   # its rhythm's phase until its first frame (opened_together)

    # client side
    def append(self, pcm: np.ndarray) -> None:
        """Append float32 samples in [-1, 1] at 16 kHz, any length; they are regrouped into frames."""
        n = self.engine.frame_samples
        with self._lock:
            if self.closed:
                raise CallClosed(f"call {self.id} has ended")
            if self.input_ended:
                raise CallClosed(f"call {self.id}: append after end of input")
            budget = self.engine.max_pending_frames
            pending = len(self._frames) + (self._buf.size + pcm.size) / n
            if pending > budget:
                raise InputBudgetExceeded(
                    f"pending input would be {pending * n / self.engine.sample_rate:.2f} s; the limit is "
                    f"engine.max_pending_s = {self.engine.cfg.max_pending_s:g} s per call")
            # one copy of the input (the caller may reuse its array); frames are views of it. The
            # event loop takes a lockstep burst's appends one after another, so this is per-call cost
            # that the burst's first frame waits for
            pcm = np.array(pcm, dtype=np.float32)
            if self._buf.size:
                pcm = np.concatenate([self._buf, pcm])
            now = time.monotonic()
            whole = pcm.size - pcm.size % n
            for k in range(0, whole, n):
                self._frames.append((pcm[k:k + n], now))
                self.frames_in += 1
                self.last_ready = now
            self._buf = pcm[whole:]
        self.engine.wake()

    def end_input(self) -> None:
        """No more audio: a partial last frame is zero-padded; a DrainedEvent follows the last frame."""
        n = self.engine.frame_samples
        with self._lock:
            if self.closed or self.input_ended:
                return
            if self._buf.size:
                self._frames.append((np.pad(self._buf, (0, n - self._buf.size)), time.monotonic()))
                self._buf = np.zeros(0, dtype=np.float32)
                self.frames_in += 1
            self.input_ended = True
        self.engine.wake()

    def clear_pending(self) -> None:
        """Drop the input received but not yet stepped (whole frames and the partial one)."""
        with self._lock:
            self._frames.clear()
            self._buf = np.zeros(0, dtype=np.float32)

    def abort(self, reason: str = "aborted", message: str = "") -> None:
        """End the call now; its slot is freed before the next tick."""
        self.engine.request_end(self, reason, message)

    def inject_function_tokens(self, ids: list[int]) -> None:
        """Force these tokens onto the function channel, one per frame (tool results, spec 3.9)."""
        with self._lock:
            self._forced.extend(int(i) for i in ids)

    def inject_text_tokens(self, ids: list[int]) -> None:
        """Force these tokens onto the agent's text channel, one per frame: the talker speaks them, and the
        LLM hears them as what the agent said (an on-hold message while a tool runs)."""
        with self._lock:
            self._forced.extend(forced_text(int(i)) for i in ids)

    @property
    def pending_frames(self) -> int:
        with self._lock:
            return len(self._frames)

    @property
    def has_pending_audio(self) -> bool:
        """Any audio received but not stepped: whole frames or a partial one."""
        with self._lock:
            return bool(self._frames) or self._buf.size > 0

    # engine side
    @property
    def has_frame(self) -> bool:
        """A whole frame waits. Without the lock: a deque's length is read atomically, and the engine's waits
        call this on every wake-up."""
        return bool(self._frames)

    def pacing(self) -> tuple[float | None, float | None, int]:
        """(arrival of the oldest pending frame or None, arrival of the last frame or None, frames pending),
        read under one lock: read one at a time, an append landing in between gave "1 pending, oldest
        None", which crashed the engine thread under load (H200, 128 lockstep calls)."""
        with self._lock:
            return (self._frames[0][1] if self._frames else None), self.last_ready, len(self._frames)

    def take_frame(self):
        with self._lock:
            if not self._frames:
                return None
            audio, ready = self._frames.popleft()
            forced = self._forced.popleft() if self._forced else -1
            return audio, ready, forced
