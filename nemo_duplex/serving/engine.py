"""The step loop: every call that has a whole 80 ms frame pending advances by one frame in one batched
step, live appends and uploads alike.

The engine owns the state pools (state.py) and the calls. Clients (the server, run_clip, tests) talk to
it only through `Call`: `append` PCM of any length, `end_input`, `abort`, `inject_function_tokens`, and
they receive events through the callback they passed to `open_call`. The loop never blocks on a client
(appends and events cross threads through locks and callbacks) and knows nothing about sockets or file
formats. Calls join and leave between ticks; a call's slot is returned when it ends, however it ends.
"""
from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from graphs.capture import step_to_host
from nemo_duplex.audio import to_pcm16
from nemo_duplex.models.config import SamplingParams
from nemo_duplex.serving.frame_step import admit, special_ids
from nemo_duplex.serving.state import PrefixCache, SlotAllocator, allocate_call_state
from nemo_duplex.settings import EngineConfig


# ---- errors a client can get ------------------------------------------------------------------------
class EngineError(Exception):
    code = "engine_error"


class EngineBusy(EngineError):
    code = "busy"


class PromptTooLong(EngineError):
    code = "prompt_too_long"


class InputBudgetExceeded(EngineError):
    code = "input_budget_exceeded"


class CallClosed(EngineError):
    code = "call_closed"


class EngineDown(EngineBusy):
    """The engine stopped after a device error: no call can be served until the process restarts."""
    code = "engine_down"


def device_lost(e: BaseException) -> bool:
    """A CUDA error (a device-side assert, an illegal access) poisons the process's CUDA context: every
    later step would fail too, so the engine stops instead of failing each new call."""
    return isinstance(e, getattr(torch, "AcceleratorError", ())) or "CUDA error" in str(e)


# ---- events -------------------------------------------------------------------------------------------
@dataclass
class CallOptions:
    prompt: str | None = None
    seed: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speaker: str | None = None


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
        self._text_due: InFlight | None = None
        self._speech_due: InFlight | None = None
        self.admitted = False
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
        self.engine._wake()

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
        self.engine._wake()

    def abort(self, reason: str = "aborted", message: str = "") -> None:
        """End the call now; its slot is freed before the next tick."""
        self.engine._request_end(self, reason, message)

    def inject_function_tokens(self, ids: list[int]) -> None:
        """Force these tokens onto the function channel, one per frame (tool results, spec 3.9)."""
        with self._lock:
            self._forced.extend(int(i) for i in ids)

    @property
    def pending_frames(self) -> int:
        with self._lock:
            return len(self._frames)

    # engine side
    def _pacing(self) -> tuple[float | None, float | None, int]:
        """(arrival of the oldest pending frame or None, arrival of the last frame or None, frames pending),
        read under one lock: read one at a time, an append landing in between gave "1 pending, oldest
        None", which crashed the engine thread under load (H200, 128 lockstep calls)."""
        with self._lock:
            return (self._frames[0][1] if self._frames else None), self.last_ready, len(self._frames)

    def _take_frame(self):
        with self._lock:
            if not self._frames:
                return None
            audio, ready = self._frames.popleft()
            forced = self._forced.popleft() if self._forced else -1
            return audio, ready, forced


class Engine:
    def __init__(self, model, tokenizer, cfg: EngineConfig | None = None, device: torch.device | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.cfg = cfg or EngineConfig()
        self.device = device or model.stt_model.embed_tokens.weight.device
        mc = model.cfg
        self.frame_samples = mc.samples_per_frame_in
        self.sample_rate = mc.source_sample_rate
        self.max_frames = math.ceil(self.cfg.max_call_s / mc.frame_length)
        self.max_pending_frames = math.ceil(self.cfg.max_pending_s / mc.frame_length)
        self.frame_seconds = mc.frame_length
        self.state = allocate_call_state(model, self.cfg.max_calls, self.max_frames, self.device,
                                         self.cfg.max_prompt_tokens)
        self.slots = SlotAllocator(self.cfg.max_calls)
        self.specials = special_ids(model, self.device)
        self._calls: dict[str, Call] = {}
        self._to_admit: deque[Call] = deque()
        self._to_end: dict[str, tuple[str, str]] = {}
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._running = False
        from graphs.capture import StepRunner, buckets_for
        buckets = buckets_for(self.cfg.capture_buckets, self.cfg.max_calls)
        self.step_runner = StepRunner(model, self.state, self.specials,
                                      buckets[-1:] if self.cfg.batch_invariant else buckets,
                                      graphs=self.cfg.graphs, backend=self.cfg.graph_backend,
                                      greedy_graphs=self.cfg.greedy_graphs, side_stream=self.cfg.side_stream,
                                      pad_eager=self.cfg.batch_invariant, pipeline=self.cfg.pipeline,
                                      llm_sm_carveout=self.cfg.llm_sm_carveout)
        self.ready = False        # set once every capture bucket is recorded (GET /health)
        # (with graphs "auto", step_runner.graphs says what was chosen)
        self.down: str | None = None  # set when a device error stopped the engine (device_lost)
        self.stats = EngineStats()
        self.prefix_cache = PrefixCache(self.cfg.prefix_cache_entries)
        self._last_step: tuple[float, float] | None = None  # (monotonic start, seconds) of the last step
        self._last_open: float | None = None  # monotonic time of the last open_call (engine.open_quiet_ms)
        self.longest_token = max(len(t) for t in tokenizer.token_strings())   # characters (prompt_ids)

    # ---- client API --------------------------------------------------------------------------------
    def open_call(self, options: CallOptions | None = None, on_event: Callable | None = None,
                  call_id: str | None = None) -> Call:
        """Reserve a slot now (EngineBusy if none is free: never a queue that grows without bound);
        the prompt prefill and talker warm-up run on the engine thread before the first frame."""
        options = options or CallOptions()
        if self.down is not None:
            raise EngineDown(f"the engine stopped after a device error and needs a restart: {self.down}")
        slot = self.slots.take()
        if slot is None:
            raise EngineBusy(f"all {self.cfg.max_calls} call slots are in use (engine.max_calls)")
        call = Call(self, call_id or f"call_{next(self._ids)}", options, on_event or (lambda ev: None))
        call.slot = slot
        with self._lock:
            self._calls[call.id] = call
            self._to_admit.append(call)
            self._last_open = time.monotonic()
            self._work.notify()
        return call

    @property
    def active_calls(self) -> int:
        return self.slots.in_use

    def _wake(self) -> None:
        with self._lock:
            self._work.notify()

    def _request_end(self, call: Call, reason: str, message: str) -> None:
        with self._lock:
            if call.id in self._calls and call.id not in self._to_end:
                self._to_end[call.id] = (reason, message)
                self._work.notify()

    # ---- the loop ----------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Capture every bucket (largest first) before serving; never while serving."""
        if not self.ready:
            self.step_runner.capture()
            self.ready = True

    def start(self) -> None:
        self.prepare()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for call in list(self._calls.values()):
            self._end(call, "shutdown", "the engine stopped")

    def _coalesce(self) -> None:
        """Hold the step while `coalesce_wait` says a live call's frame is due soon (engine.coalesce_ms),
        while a call opened together with one whose first frame is pending has none yet (opened_together)
        or calls are opening (engine.open_quiet_ms), both within the same bound, and while `duty_wait` says
        the engine would exceed engine.max_duty and some live call has no frame yet. One scan of the calls
        decides how long and for whom; each wake-up (every append notifies) then only looks at the calls
        still awaited, so a burst of N appends costs O(N^2) cheap checks, not N scans with a lock per call
        (the event loop needs the GIL meanwhile)."""
        with self._lock:   # calls still to be admitted too: admission runs in the same tick as their step
            live = [c for c in self._calls.values() if not c.closed and not c.input_ended]
        limit = coalesce_limit(self.cfg.coalesce_ms / 1e3,
                               self._last_step if self.cfg.coalesce_at_most_step else None)
        quiet = self.cfg.open_quiet_ms / 1e3
        if limit <= 0 and self.cfg.max_duty <= 0:
            return
        now = time.monotonic()
        pacing = [c._pacing() for c in live]
        deadline = coalesce_deadline(pacing, limit) if limit > 0 else None
        wait = coalesce_wait(pacing, now, limit, self.frame_seconds) if limit > 0 else 0.0
        # the duty hold: calls without a frame are what a held step would gain
        idle = [c for c, (_, _, pending) in zip(live, pacing) if pending == 0]
        held = duty_wait(pacing, now, self._last_step, self.cfg.max_duty, self.cfg.duty_hold_cap_ms / 1e3) \
            if idle else 0.0

        def opening_until() -> float:  # re-read on every wake-up: each open_call moves it
            if quiet <= 0 or deadline is None or self._last_open is None:
                return 0.0
            return min(self._last_open + quiet, deadline)

        # calls opened with a call whose first frame is pending, still without a frame of their own
        firsts = sorted(c.opened_at for c, (_, _, pending) in zip(live, pacing) if pending and c.frames_stepped == 0)
        fresh = [c for c, (_, last, pending) in zip(live, pacing)
                 if last is None and not pending and opened_together(c.opened_at, firsts, limit)] \
            if self.cfg.wait_opened_together and firsts and deadline is not None and now < deadline else []
        if fresh:
            wait = max(wait, deadline - now)
        if wait <= 0 and held <= 0 and now >= opening_until():
            return
        coalesce_end, duty_end = now + wait, now + held
        awaited = fresh + [c for c, (_, last, pending) in zip(live, pacing)
                           if frame_due(last, pending, coalesce_end, self.frame_seconds)]

        def arrived(c: Call) -> bool:  # len() needs no lock
            return bool(c._frames) or c.closed or c.input_ended

        while self._running:
            coalescing = awaited and now < coalesce_end
            holding = idle and now < duty_end
            open_end = opening_until()
            if not (coalescing or holding or now < open_end):
                break
            with self._lock:
                self._work.wait(timeout=min(max(coalesce_end if coalescing else 0.0, duty_end if holding else 0.0,
                                                open_end) - now, self.cfg.idle_wait_s))
            awaited = [c for c in awaited if not arrived(c)]
            idle = [c for c in idle if not arrived(c)]
            now = time.monotonic()

    def _run(self) -> None:
        while self._running:
            try:
                self._coalesce()
            except Exception:  # noqa: BLE001 - coalescing only times the step: a bug in it must not stop the engine
                traceback.print_exc()
            try:
                did = self.tick()
            except Exception as e:  # a bug must not leave calls hanging: end every call with the reason
                traceback.print_exc()
                if device_lost(e):  # the thread ends: /health says engine_down (503), new calls are refused
                    self.down = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    self._running = False
                for call in list(self._calls.values()):
                    self._end(call, "error", f"engine error: {type(e).__name__}: {e}")
                did = True
            if not did:
                with self._lock:
                    self._work.wait(timeout=self.cfg.idle_wait_s)

    @torch.no_grad()
    def tick(self) -> bool:
        """One pass: end calls asked to end, admit new calls, step every call with a frame pending."""
        with self._lock:
            ending = [(self._calls[cid], r) for cid, r in self._to_end.items() if cid in self._calls]
            self._to_end.clear()
            admitting = list(self._to_admit)
            self._to_admit.clear()
        for call, (reason, message) in ending:
            self._end(call, reason, message)
        for call in admitting:
            if not call.closed:
                self._admit(call)

        gathered = time.perf_counter()
        batch = []
        with self._lock:
            calls = list(self._calls.values())
        now = time.monotonic()
        for call in calls:
            if not call.admitted or call.closed:
                continue
            last = call._text_due or call._speech_due   # the frame in flight that stepped last
            if call.frames_stepped >= self.max_frames and last is None:
                self._end(call, "limit", f"the call reached engine.max_call_s = {self.cfg.max_call_s:g} s")
                continue
            item = call._take_frame() if call.frames_stepped < self.max_frames else None
            if item is not None:
                batch.append((call, *item))
            elif last is not None and (call.input_ended or call.frames_stepped >= self.max_frames
                                       or now - last.stepped_at > self.frame_seconds):
                # pipelined: the frames in flight go on in a row with no new frame (the sink on the
                # listening half) once no next frame will carry them: the input ended, the call hit its
                # limit, or its next frame is late by a whole frame period
                batch.append((call, None, None, -1))
            elif call.input_ended:
                call.on_event(DrainedEvent(call.id, call.frames_out))
                self._end(call, "completed")
        if batch:
            self._step(batch, gathered)
        return bool(batch or ending or admitting)

    def prompt_ids(self, prompt: str | None) -> torch.Tensor | None:
        """The system prompt's ids (None for none), or PromptTooLong naming engine.max_prompt_tokens.
        Admission asks, and the server asks when a client sets the prompt (so the client hears it then,
        not as the call's end once its audio starts). A prompt of more characters than the limit's tokens
        can cover is refused without tokenizing it: a megabyte of instructions would hold the thread
        doing it (the server's event loop, or this engine's) for the tokenizer."""
        limit = self.cfg.max_prompt_tokens
        if prompt and len(prompt) > limit * self.longest_token:
            raise PromptTooLong(f"the system prompt is {len(prompt)} characters, more than "
                                f"engine.max_prompt_tokens = {limit} tokens can hold")
        ids = self.model.prompt_ids(self.tokenizer, prompt)
        if ids is not None and ids.numel() > limit:
            raise PromptTooLong(f"the system prompt is {ids.numel()} tokens; the limit is "
                                f"engine.max_prompt_tokens = {limit}")
        return ids

    def _admit(self, call: Call) -> None:
        try:
            prompt_ids = self.prompt_ids(call.options.prompt)
            admit(self.model, self.state, call.slot, prompt_ids, call.options.seed, call.options.sampling,
                  call.options.speaker, self.prefix_cache)
            call.admitted = True
        except Exception as e:
            self._end(call, "error", str(e))

    def _step(self, batch, gathered: float) -> None:
        started = time.monotonic()
        t0 = time.perf_counter()
        n = len(batch)
        sink = self.state.sink
        depth = int(self.cfg.pipeline)
        silence = np.zeros(self.frame_samples, dtype=np.float32)
        # a row's slot on each half: the listening half hears its call's new frame (the sink for a row with
        # none); pipelined, the text half runs the frame heard last step (two deep; one deep: the new frame)
        # and the speech half the frame whose text is done, each the sink where the call has no such frame
        slots = np.array([c.slot if a is not None else sink for c, a, _, _ in batch], dtype=np.int64)
        audio = np.stack([a if a is not None else silence for _, a, _, _ in batch])
        speech = text = None
        if depth >= 1:
            speech = np.array([c.slot if c._speech_due is not None else sink for c, *_ in batch], dtype=np.int64)
        if depth == 2:   # the forced token goes with its frame's text half
            text = np.array([c.slot if c._text_due is not None else sink for c, *_ in batch], dtype=np.int64)
            forced = np.array([c._text_due.forced if c._text_due is not None else -1 for c, *_ in batch],
                              dtype=np.int64)
        else:
            forced = np.array([f for *_, f in batch], dtype=np.int64)
        sampling = not all(call.options.sampling.greedy for call, *_ in batch)
        host = step_to_host(self.step_runner, slots, audio, forced, sampling, speech, text)  # numpy in and out
        waited = time.perf_counter()
        launched = host.launched
        out = host.outputs
        # Python lists and numpy rows once per step: indexing torch tensors per call costs ~0.1 ms a call
        # (9 ms per step at 96 calls, measured on the CPU), which the GPU would wait for.
        text_out, func, top2, user, codes, pcm = (out["text"].tolist(), out["func"].tolist(), out["top2"].tolist(),
                                                  out["user"].tolist(), out["codes"], out["pcm"])
        # the packets' int16 audio in one numpy pass here rather than one per frame on the server's event
        # loop, which sends a lockstep batch's packets one after another (this repository's CPU, 160
        # calls: 1.0 ms per step frame by frame, 0.15 ms batched)
        pcm16 = to_pcm16(pcm)
        sent = time.monotonic()

        def hand_out(call: Call, frame: InFlight, i: int) -> None:
            """The frame's event, whole now that its speech half ran in row i."""
            call.frames_out += 1
            call.on_event(FrameEvent(call.id, frame.frame, frame.text, frame.func, pcm[i], frame.user, frame.top2,
                                     codes[i], frame.ready_at, sent, pcm16[i].tobytes()))
        for i, (call, frame_audio, ready, forced_i) in enumerate(batch):
            if speech is not None and speech[i] != sink:   # a frame's speech: its event is whole now
                due, call._speech_due = call._speech_due, None
                hand_out(call, due, i)
            heard = None
            if frame_audio is not None:
                heard = InFlight(call.frames_stepped, ready, sent, [t for t in user[i] if t >= 0], forced_i)
                call.frames_stepped += 1
            if depth == 2:   # the text half ran last step's frame; the new one waits for its own
                spoken, call._text_due = call._text_due, heard
            else:
                spoken = heard
            if spoken is None:
                continue
            spoken.text, spoken.func, spoken.top2, spoken.stepped_at = text_out[i], func[i], tuple(top2[i]), sent
            if depth >= 1:
                call._speech_due = spoken
                continue
            hand_out(call, spoken, i)
        done = time.perf_counter()
        self._last_step = (started, done - t0)
        self.stats.record_step(n, done - t0, gather=t0 - gathered, prep=launched - t0, device=waited - launched,
                               dispatch=done - waited, padded=host.padded_rows)

    def _end(self, call: Call, reason: str, message: str = "") -> None:
        with self._lock:
            if self._calls.pop(call.id, None) is None:
                return
        call.closed = True
        self.slots.give(call.slot)
        try:
            call.on_event(EndedEvent(call.id, reason, message))
        except Exception:
            traceback.print_exc()

    # ---- driving clips without a server (run_clip mode=engine, tests) -------------------------------
    def run_clips(self, clips: list[torch.Tensor], offsets: list[int] | None = None, prompt: str | None = None,
                  seed: int = 0, sampling: SamplingParams | None = None, uploads: list[bool] | None = None):
        """Run clips through the engine on the calling thread: clip i opens at tick offsets[i] with seed
        seed + i, and is fed one frame per tick (live) or all at once (upload). Returns ClipResults."""
        from nemo_duplex.models.model import ClipResult

        offsets = offsets or [0] * len(clips)
        uploads = uploads or [False] * len(clips)
        events: dict[int, list] = {i: [] for i in range(len(clips))}
        calls: dict[int, Call] = {}
        fed = [0] * len(clips)
        n = self.frame_samples
        tick = 0
        while True:
            for i, clip in enumerate(clips):
                if i not in calls and tick >= offsets[i]:
                    opts = CallOptions(prompt=prompt, seed=seed + i, sampling=sampling or SamplingParams())
                    calls[i] = self.open_call(opts, on_event=events[i].append)
                    if uploads[i]:
                        calls[i].append(clip.numpy())
                        calls[i].end_input()
                        fed[i] = clip.shape[0]
                if i in calls and not uploads[i] and fed[i] < clip.shape[0]:
                    calls[i].append(clip[fed[i]: fed[i] + n].numpy())
                    fed[i] += n
                    if fed[i] >= clip.shape[0]:
                        calls[i].end_input()
            self.tick()
            tick += 1
            if len(calls) == len(clips) and all(c.closed for c in calls.values()):
                break
        results = []
        for i in range(len(clips)):
            frames = [e for e in events[i] if isinstance(e, FrameEvent)]
            ended = [e for e in events[i] if isinstance(e, EndedEvent)]
            if ended and ended[-1].reason != "completed":
                raise EngineError(f"clip {i} ended with {ended[-1].reason}: {ended[-1].message}")
            results.append(ClipResult(
                encoder_out=torch.empty(0), audio_embeds=torch.empty(0),
                text_tokens=torch.tensor([f.text for f in frames], dtype=torch.int64),
                function_tokens=torch.tensor([f.func for f in frames], dtype=torch.int64),
                text_logits_top2=torch.tensor([f.top2 for f in frames]),
                codes=torch.from_numpy(np.stack([f.codes for f in frames])) if frames else torch.empty(0),
                wav=torch.from_numpy(np.concatenate([f.pcm for f in frames])) if frames else torch.empty(0),
                user_tokens=[t for f in frames for t in f.user]))
        return results


def coalesce_limit(coalesce_s: float, last_step: tuple[float, float] | None) -> float:
    """The coalescing bound: engine.coalesce_ms, but never longer than the last step took. Why: with
    staggered callers some frame is always due soon, so every step was held until its oldest frame was
    coalesce_ms old and the worst frame waited the bound and then its own step (H200 load run 10, 32
    staggered calls: ~6 calls a step, 14 ms steps, p99 30.8 ms = 15 + 14 + 1.8 host). A frame held past one
    step time would have been served as soon by stepping now and again for the late ones; lockstep
    frames arrive within a few ms, well inside one step."""
    if coalesce_s <= 0:
        return 0.0
    return coalesce_s if last_step is None else min(coalesce_s, last_step[1])


def coalesce_deadline(calls: list[tuple[float | None, float | None, int]], limit: float) -> float | None:
    """When a step held for coalescing must start: the arrival of the oldest frame pending alone in its
    call (a paced frame) plus `limit`; None with no paced frame (calls as for coalesce_wait)."""
    paced = [oldest for oldest, _, pending in calls if pending == 1 and oldest is not None]
    return min(paced) + limit if paced else None


def coalesce_wait(calls: list[tuple[float | None, float | None, int]], now: float, limit: float,
                  frame_s: float) -> float:
    """How long to hold a step so that frames due together share it; 0 = step now.

    calls: per live call (arrival time of its oldest pending frame or None, arrival time of its last frame
    or None, frames pending). A call without a pending frame is waited for when its next frame is due (its
    last arrival plus one frame period) before the bound: the arrival of the oldest frame pending alone
    in its call, plus `limit`. So callers that send in lockstep are stepped together even when their
    frames reach the engine ~10 ms apart, while with staggered callers a step waits only for frames due
    within the bound, and a step whose frames are already older than the bound (the engine was busy)
    never waits. A call with a backlog (an upload being fed, or a call that fell behind) neither sets the
    bound nor is waited for: its frames are not paced, and its old frames would otherwise turn
    coalescing off for everyone while an upload runs. A call that has not sent a frame yet has no rhythm
    to go by and is not waited for."""
    deadline = coalesce_deadline(calls, limit)
    if deadline is None or now >= deadline:
        return 0.0
    due = any(frame_due(last, pending, deadline, frame_s) for _, last, pending in calls)
    return deadline - now if due else 0.0


def duty_wait(calls: list[tuple[float | None, float | None, int]], now: float,
              last_step: tuple[float, float] | None, max_duty: float, cap: float) -> float:
    """How long to hold a step so that the engine's duty stays <= max_duty; 0 = step now (engine.max_duty).

    calls: per live call as for coalesce_wait; the caller asks only while some live call has no frame
    pending. last_step: (start, seconds) of the previous step. The next step may start at
    start + seconds / max_duty, but no paced frame (the oldest of a call with exactly one pending) waits
    past its arrival + cap; with no paced frame pending (only backlogs, or nothing) there is no hold."""
    if max_duty <= 0 or last_step is None:
        return 0.0
    paced = [oldest for oldest, _, pending in calls if pending == 1 and oldest is not None]
    if not paced:
        return 0.0
    start, seconds = last_step
    until = min(start + seconds / max_duty, min(paced) + cap)
    return max(0.0, until - now)


def opened_together(opened_at: float, first_frame_opens: list[float], limit: float) -> bool:
    """A call without a frame yet has no rhythm; until its first frame its open time stands for its
    phase: it is waited for (within the coalescing bound) when it opened within `limit` of a call whose
    first frame is pending. Callers that start together open together, then send their first frames
    together (scripts/bench.py connects 1 s before the schedule starts), and the first step took only
    the first frames already in: H200 load run 10, 32 lockstep calls, 7 first frames in the first step
    and 25 a step later at 33-36 ms lag, the run's p99. Staggered callers open tens of ms apart.
    first_frame_opens: sorted (a bisection, not a scan: 160 calls opening together ask 160 times)."""
    i = bisect.bisect_left(first_frame_opens, opened_at - limit)
    return i < len(first_frame_opens) and first_frame_opens[i] <= opened_at + limit


def frame_due(last: float | None, pending: int, deadline: float, frame_s: float) -> bool:
    """A call with no frame pending whose next frame (its last arrival + one period) is due by `deadline`:
    the calls coalescing waits for."""
    return pending == 0 and last is not None and last + frame_s <= deadline


class EngineStats:
    """Counters the server exports on /metrics."""

    def __init__(self):
        self.steps = 0
        self.frames = 0
        self.step_seconds: deque[float] = deque(maxlen=1000)
        self.batch_sizes: deque[int] = deque(maxlen=1000)
        # where a step's wall time goes, summed over steps (/metrics): taking the calls' frames (before
        # the step), host work from the frames to the last launch, waiting for the device, handing the
        # frames out; and rows including capture-bucket padding
        self.gather_seconds = 0.0
        self.prep_seconds = 0.0
        self.device_seconds = 0.0
        self.dispatch_seconds = 0.0
        self.padded_rows = 0

    def record_step(self, batch: int, seconds: float, gather: float = 0.0, prep: float = 0.0, device: float = 0.0,
                    dispatch: float = 0.0, padded: int = 0) -> None:
        self.steps += 1
        self.gather_seconds += gather
        self.frames += batch
        self.step_seconds.append(seconds)
        self.batch_sizes.append(batch)
        self.prep_seconds += prep
        self.device_seconds += device
        self.dispatch_seconds += dispatch
        self.padded_rows += padded or batch
