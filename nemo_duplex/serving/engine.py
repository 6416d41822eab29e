"""The step loop: every call that has a whole 80 ms frame pending advances by one frame in one batched
step, live appends and uploads alike.

The engine owns the state pools (state.py) and the calls. Clients (the server, run_clip, tests) talk to
it only through `Call`: `append` PCM of any length, `end_input`, `abort`, `inject_function_tokens`, and
they receive events through the callback they passed to `open_call`. The loop never blocks on a client
(appends and events cross threads through locks and callbacks) and knows nothing about sockets or file
formats. Calls join and leave between ticks; a call's slot is returned when it ends, however it ends.

One file past 500 lines on purpose: the loop, its waits (pacing.py has the rules) and the admissions' and
ends' bookkeeping all work on the call table under one lock, and read best beside each other.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from nemo_duplex.audio import to_pcm16
from nemo_duplex.serving.admitter import Admitter, Cohort, held_for_cohort
from nemo_duplex.serving.calls import (
    Call,
    CallOptions,
    DrainedEvent,
    EndedEvent,
    EngineBusy,
    EngineDown,
    FrameEvent,
    InFlight,
    call_max_frames,
    device_lost,
    limit_message,
    system_prompt_ids,
)
from nemo_duplex.serving.frame_step import admission, admission_key, restore_admissions, special_ids
from nemo_duplex.serving.memory import frames_per_call, kv_page_counts
from nemo_duplex.serving.pacing import (
    backlog_hold,
    coalesce_deadline,
    coalesce_limit,
    coalesce_wait,
    duty_wait,
    frame_due,
    opened_together,
    step_gap,
)
from nemo_duplex.serving.pages import KVPages
from nemo_duplex.serving.state import PrefixCache, SlotAllocator, allocate_call_state
from nemo_duplex.serving.stats import EngineStats
from nemo_duplex.settings import EngineConfig

log = logging.getLogger(__name__)


def _busy_past(since: float | None, bound_s: float) -> float:
    """Seconds since `since` (None: not busy) where they exceed bound_s, else 0."""
    busy = time.monotonic() - since if since is not None else 0.0
    return busy if busy > bound_s else 0.0


def build_engine(model, tokenizer, cfg: EngineConfig | None = None, device: torch.device | None = None) -> "Engine":
    """An engine for `model` with settings `cfg`: its state pools (one slot per call, plus the sink) and
    the step runner over them (serving/runner.py: the capture buckets, the pipeline depth, the graphs)."""
    from nemo_duplex.serving.runner import admission_graphs, engine_runner

    cfg = cfg or EngineConfig()
    device = device or model.stt_model.embed_tokens.weight.device
    if cfg.max_calls is None:   # null: the places the device holds (the server settles it before loading)
        from nemo_duplex.serving.memory import calls_for_device

        cfg = replace(cfg, max_calls=calls_for_device(model.cfg, device, cfg))
    max_frames = frames_per_call(model.cfg, cfg.max_call_s)
    pages = kv_page_counts(model.cfg, cfg.max_calls, cfg.max_call_s, cfg.max_prompt_tokens, cfg.kv_page_len,
                           cfg.kv_pool_gib)
    state = allocate_call_state(model, cfg.max_calls, max_frames, device, cfg.max_prompt_tokens, pages)
    specials = special_ids(model, device)
    return Engine(model, tokenizer, cfg, state, engine_runner(model, state, specials, cfg),
                  admission_graphs(model, state, cfg))


class Engine:
    """The step loop over `state` (serving/state.py CallState: the pools, one slot per call), stepping through
    `runner` (a graphs.capture.HostStepper: serving/runner.py builds the real one; `build_engine` makes all
    three), admitting calls through `admission_graphs` where given (serving/admission_graphs.py)."""

    def __init__(self, model, tokenizer, cfg: EngineConfig, state, runner, admission_graphs=None):
        self.model, self.tokenizer = model, tokenizer
        self.cfg = cfg
        if cfg.prefix_cache_mib < 0:
            raise ValueError(f"engine.prefix_cache_mib = {cfg.prefix_cache_mib}: MiB the prefix cache may hold, "
                             ">= 0 (0 turns it off)")
        if cfg.max_step_s <= 0:
            raise ValueError(f"engine.max_step_s = {cfg.max_step_s}: seconds after which a step still under way "
                             "marks the engine stalled, > 0")
        if cfg.max_admission_s <= 0:
            raise ValueError(f"engine.max_admission_s = {cfg.max_admission_s}: seconds a call may wait for its "
                             "admission, > 0")
        if not 0 <= cfg.admission_gap_wait_ms < math.inf:
            raise ValueError(f"engine.admission_gap_wait_ms = {cfg.admission_gap_wait_ms}: how long an admission "
                             "piece may wait for a gap between steps, >= 0 ms (0: no wait)")
        for key in ("max_admission_s", "admission_gap_wait_ms"):
            if not cfg.admission_thread and getattr(cfg, key) != getattr(EngineConfig, key):
                log.warning("engine.%s=%g is unused: engine.admission_thread=false admits on the engine thread, "
                            "between steps", key, getattr(cfg, key))
        if cfg.admission_pieces_per_tick < 1 or cfg.prefill_chunk_tokens < 0:
            raise ValueError(f"engine.admission_pieces_per_tick = {cfg.admission_pieces_per_tick} (>= 1) and "
                             f"engine.prefill_chunk_tokens = {cfg.prefill_chunk_tokens} (>= 0, 0: whole): an "
                             "admission would never finish")
        mc = model.cfg
        self.frame_samples = mc.samples_per_frame_in
        self.sample_rate = mc.source_sample_rate
        self.max_pending_frames = math.ceil(self.cfg.max_pending_s / mc.frame_length)
        self.frame_seconds = mc.frame_length
        self.state = state
        self.slots = SlotAllocator(self.cfg.max_calls)
        # the calls' KV pages (serving/pages.py); None: unpaged pools (tests that build their own state)
        self.pages = KVPages(state, mc.prompt_frames, cfg.max_prompt_tokens) if state.llm.pages is not None else None
        self._calls: dict[str, Call] = {}
        self._to_admit: deque[Call] = deque()
        self._admitting: deque[tuple[Call, Iterator]] = deque()   # admissions under way, a piece per next()
        # (with its own thread only: an engine driven tick by tick (serving/drive.py) admits inline)
        self.admitter: Admitter | None = None
        self._to_end: dict[str, tuple[str, str]] = {}
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._running = False
        self.step_runner = runner
        self.admission_graphs = admission_graphs   # captured in prepare(), with the steps
        self.ready = False        # set once every capture bucket is recorded (GET /health)
        # (with graphs "auto", step_runner.graphs says what was chosen)
        self.down: str | None = None  # set when a device error stopped the engine (device_lost)
        self.stats = EngineStats()
        self.prefix_cache = PrefixCache(self.cfg.prefix_cache_mib * 2**20)
        self._last_step: tuple[float, float] | None = None  # (monotonic start, seconds) of the last step
        # while the engine thread waits on the device: a step, or an inline admission piece (engine_stalled_s)
        self.busy_since: float | None = None
        self._step_seconds: dict[int, float] = {}   # rows -> seconds of the last step of that many rows
        self.step_ended = threading.Condition()   # notified as each step ends (stats.steps counts them)
        self._last_open: float | None = None  # monotonic time of the last open_call (engine.open_quiet_ms)
        self.longest_token = max(len(t) for t in tokenizer.token_strings())   # characters (prompt_ids)

    # ---- client API --------------------------------------------------------------------------------
    def open_call(self, options: CallOptions | None = None, on_event: Callable | None = None,
                  call_id: str | None = None) -> Call:
        """Reserve a slot and commit the KV pages the call's limit could need now (EngineBusy if either is
        short: never a queue that grows without bound); the prompt prefill and talker warm-up come later."""
        options = options or CallOptions()
        if self.down is not None:
            raise EngineDown(f"the engine stopped after a device error and needs a restart: {self.down}")
        max_frames = call_max_frames(options, self.cfg.max_call_s, self.frame_seconds)   # <= state.max_frames
        slot = self.slots.take()
        if slot is None:
            raise EngineBusy(f"all {self.cfg.max_calls} call slots are in use (engine.max_calls)")
        if self.pages is not None and not self.pages.open_call(slot, max_frames):
            self.slots.give(slot)
            raise EngineBusy(f"the KV pages (engine.kv_pool_gib = {self.cfg.kv_pool_gib} GiB) are committed to the "
                             f"live calls: a call of up to {max_frames * self.frame_seconds:g} s does not fit beside them")
        call = Call(self, call_id or f"call_{next(self._ids)}", options, on_event or (lambda ev: None))
        call.slot = slot
        call.max_frames = max_frames
        with self._lock:
            self._calls[call.id] = call
            self._to_admit.append(call)
            self._last_open = time.monotonic()
            self._work.notify()
        return call

    @property
    def active_calls(self) -> int:
        return self.slots.in_use

    @property
    def alive(self) -> bool:
        """The loop's thread is running (false before start, after stop, or after a device error ended it)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def engine_stalled_s(self) -> float:
        """How long the engine thread's step (or inline admission piece) under way has been running past
        engine.max_step_s (0: none has): a kernel that never finishes (a wedged GPU) holds the engine thread,
        which cannot say so itself; /health does."""
        return _busy_past(self.busy_since, self.cfg.max_step_s)

    @property
    def admission_stalled_s(self) -> float:
        """How long the admission thread has been on one call past engine.max_admission_s (0: it is not)."""
        return _busy_past(self.admitter.busy_since if self.admitter is not None else None, self.cfg.max_admission_s)

    def step_gap(self) -> float:
        """Seconds until the live calls' next step is due (pacing.step_gap; 0 while a step is under way): the
        admission thread starts each piece of an admission only where it fits (engine.admission_gap_wait_ms)."""
        if self.busy_since is not None:
            return 0.0
        with self._lock:
            live = [c for c in self._calls.values() if c.admitted and not c.closed]
        return step_gap([c.pacing() for c in live], time.monotonic(), self.frame_seconds)

    def wake(self) -> None:
        with self._lock:
            self._work.notify()

    def request_end(self, call: Call, reason: str, message: str) -> None:
        with self._lock:
            if call.id in self._calls and call.id not in self._to_end:
                self._to_end[call.id] = (reason, message)
                self._work.notify()

    # ---- the loop ----------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Capture every bucket (largest first) before serving; never while serving."""
        if not self.ready:
            self.step_runner.capture()
            if self.admission_graphs is not None:   # (an engine built by hand may have none)
                self.admission_graphs.capture()
            self.ready = True

    def start(self) -> None:
        self.prepare()
        if self.cfg.admission_thread:
            self.admitter = Admitter(self)
            self.admitter.start()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.admitter is not None:
            self.admitter.stop()
        for call in list(self._calls.values()):
            self._end(call, "shutdown", "the engine stopped")

    def _live_calls(self) -> list[Call]:
        """The calls that may still send frames (those still to be admitted too: admission runs in the
        same tick as their step); a call at its limit gets no more frames."""
        with self._lock:
            return [c for c in self._calls.values() if not c.closed and not c.input_ended
                    and c.frames_stepped < c.max_frames]

    def _hold_backlog(self, live: list[Call], pacing: list[tuple]) -> bool:
        """Hold a step that would take only backlogs while `backlog_hold` says it would run into the paced
        calls' next frames: until one of those arrives (then `_coalesce` gathers the rest) or is due.
        live, pacing: the live calls and their `pacing()`, as `_coalesce` read them. Whether it held."""
        if self.cfg.coalesce_ms <= 0:
            return False
        backlogs = sum(pending > 1 for _, _, pending in pacing)
        if not backlogs:
            return False
        longer = [s for rows, s in self._step_seconds.items() if rows >= backlogs]
        estimate = min(longer) if longer else (self._last_step[1] if self._last_step else 0.0)
        now = time.monotonic()
        end = now + backlog_hold(pacing, now, self.frame_seconds, estimate)
        if now >= end:
            return False
        paced = [c for c, (_, last, pending) in zip(live, pacing) if pending == 0 and last is not None]
        while self._running and now < end and not any(c.has_frame or c.closed or c.input_ended for c in paced):
            with self._lock:
                self._work.wait(timeout=min(end - now, self.cfg.idle_wait_s))
            now = time.monotonic()
        return True

    def _coalesce(self) -> None:
        """Hold the step while `coalesce_wait` says a live call's frame is due soon (engine.coalesce_ms),
        while a call opened together with one whose first frame is pending has none yet (opened_together)
        or calls are opening (engine.open_quiet_ms), both within the same bound, and while `duty_wait` says
        the engine would exceed engine.max_duty and some live call has no frame yet; first, a step of backlogs
        only waits for the paced calls' next frames where `_hold_backlog` says so. One scan of the calls
        decides how long and for whom; each wake-up (every append notifies) then only looks at the calls
        still awaited, so a burst of N appends costs O(N^2) cheap checks, not N scans with a lock per call
        (the event loop needs the GIL meanwhile)."""
        live = self._live_calls()
        limit = coalesce_limit(self.cfg.coalesce_ms / 1e3,
                               self._last_step if self.cfg.coalesce_at_most_step else None)
        quiet = self.cfg.open_quiet_ms / 1e3
        if limit <= 0 and self.cfg.max_duty <= 0:
            return
        pacing = [c.pacing() for c in live]
        if self._hold_backlog(live, pacing):   # it waited: what it saw is old
            live = self._live_calls()
            pacing = [c.pacing() for c in live]
        now = time.monotonic()
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
                           if frame_due(last, pending, coalesce_end, self.frame_seconds, now)]

        def arrived(c: Call) -> bool:
            return c.has_frame or c.closed or c.input_ended

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
        with self._step_stream():
            self._loop()

    def _step_stream(self):
        """With the admission thread on CUDA, the engine thread steps on a stream of the highest priority
        (the admission's has the lowest): when both have kernels waiting, the GPU's block scheduler starts
        the step's first, so an admission's prefill fills only what the live calls' steps leave idle."""
        if self.admitter is None or self.admitter.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(torch.cuda.Stream(self.admitter.device, priority=-100))   # clamped to the highest

    def _loop(self) -> None:
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
        cohort = Cohort() if self.admitter is not None and admitting else None   # the calls submitted now
        restorable: dict[tuple, list[Call]] = {}   # inline: calls the prefix cache admits, by its key
        for call in admitting:
            if not call.closed:
                self._admit(call, cohort, restorable)
        if self.admitter is not None:
            self._take_admitted()
        else:
            for key, calls in restorable.items():
                self._restore_inline(key, calls)
            self._advance_admissions()

        gathered = time.perf_counter()
        batch = []
        with self._lock:
            calls = list(self._calls.values())
        now = time.monotonic()
        for call in calls:
            if not call.admitted or call.closed or held_for_cohort(call, now, self.cfg.coalesce_ms / 1e3):
                continue
            last = call.text_due or call.speech_due   # the frame in flight that stepped last
            if call.frames_stepped >= call.max_frames and last is None:
                # at the limit, the call ends with "limit" only once audio past it arrives; input of exactly
                # max_call_s completes, also when its end-of-input is still on its way (it waits for it)
                if call.has_pending_audio:
                    self._end(call, "limit", limit_message(call.options, self.cfg.max_call_s))
                    continue
                if not call.input_ended:
                    continue
            item = call.take_frame() if call.frames_stepped < call.max_frames else None
            if item is not None:
                batch.append((call, *item))
            elif last is not None and (call.input_ended or call.frames_stepped >= call.max_frames
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
        return bool(batch or ending or admitting or self._admitting or (self.admitter and self.admitter.done))

    def prompt_ids(self, prompt: str | None) -> torch.Tensor | None:
        """The system prompt's ids (calls.system_prompt_ids): admission asks, and the server asks when a
        client sets the prompt (so the client hears it then, not as the call's end once its audio starts)."""
        return system_prompt_ids(self.model, self.tokenizer, prompt, self.cfg.max_prompt_tokens, self.longest_token)

    def _admit(self, call: Call, cohort: "Cohort | None" = None,
               restorable: dict[tuple, list[Call]] | None = None) -> None:
        """Start the call's admission: on the admission thread (with `cohort`, the calls submitted in this
        tick), else inline: a call whose prompt and speaker the prefix cache holds joins `restorable` (restored
        with the others this tick), any other call's admission runs in pieces between steps."""
        try:
            prompt_ids = self.prompt_ids(call.options.prompt)
        except Exception as e:
            self._end(call, "error", str(e))
            return
        call.prompt_tokens = 0 if prompt_ids is None else prompt_ids.numel()
        if self.pages is not None:
            self.pages.admitted(call)
        key = admission_key(self.model, prompt_ids, call.options.speaker)
        pieces = admission(self.model, self.state, call.slot, prompt_ids, call.options.seed, call.options.sampling,
                           call.options.speaker, self.prefix_cache, self.cfg.prefill_chunk_tokens,
                           self.admission_graphs)
        if self.admitter is not None:
            call.cohort, call.in_admission = cohort, True
            call.admission_submitted = time.monotonic()
            cohort.pending += 1
            self.admitter.submit(call, pieces, key)
        elif restorable is not None and key in self.prefix_cache:
            restorable.setdefault(key, []).append(call)
        else:
            self._admitting.append((call, pieces))

    def restore_together(self, key: tuple, calls: list[Call]) -> None:
        """Admit `calls`, whose prompt and speaker are `key`, from the prefix cache's entry, all at once
        (frame_step.restore_admissions: a fixed number of device ops whatever their number)."""
        restore_admissions(self.model, self.state, [c.slot for c in calls], self.prefix_cache.get(key, len(calls)),
                           [c.options.seed for c in calls], [c.options.sampling for c in calls])

    def _restore_inline(self, key: tuple, calls: list[Call]) -> None:
        self.busy_since = time.monotonic()
        try:
            self.restore_together(key, calls)
        except Exception as e:  # noqa: BLE001 - the calls end with it; the engine goes on
            for call in calls:
                self._end(call, "error", str(e))
        else:
            for call in calls:
                call.admitted = True
        finally:
            self.busy_since = None

    def _take_admitted(self) -> None:
        """The admissions the admission thread finished: their calls step from this tick on."""
        while self.admitter.done:
            call, error = self.admitter.done.popleft()
            call.cohort.pending -= 1
            call.cohort.last_done = time.monotonic()
            call.in_admission = False
            if call.closed:   # ended while the thread admitted it: its slot comes back only now (_end)
                self._free_slot(call.slot)
            elif error is not None:
                self._end(call, "error", str(error))
            else:
                call.admitted = True
        self._end_overdue_admissions()

    def _end_overdue_admissions(self) -> None:
        """Calls the admission thread has held past engine.max_admission_s end with an error naming it (their
        clients hear why rather than wait on a thread that never finishes them); each slot stays the
        thread's until it is done with it (_take_admitted gives it back)."""
        if self.admitter.busy_since is None and self.admitter.jobs.empty():
            return   # no call is with the thread (those it finished were taken just before): no scan this tick
        now = time.monotonic()
        with self._lock:
            overdue = [c for c in self._calls.values() if c.in_admission
                       and now - c.admission_submitted > self.cfg.max_admission_s]
        for call in overdue:
            self._end(call, "error", f"the call was not admitted within engine.max_admission_s = "
                                     f"{self.cfg.max_admission_s:g} s")

    def _advance_admissions(self) -> None:
        """Run the admissions under way, oldest first: at most engine.admission_pieces_per_tick pieces (a
        prompt chunk, or the warm-up) between two steps while calls are live, so a new call's prompt adds a
        bounded time to their step; all of them when none is."""
        live = any(c.admitted and not c.closed for c in self._calls.values())
        budget = self.cfg.admission_pieces_per_tick if live else math.inf
        while self._admitting and budget > 0:
            call, pieces = self._admitting[0]
            if call.closed:
                self._admitting.popleft()
                continue
            budget -= 1
            self.busy_since = time.monotonic()
            try:
                next(pieces)
            except StopIteration:
                self._admitting.popleft()
                call.admitted = True
            except Exception as e:
                self._admitting.popleft()
                self._end(call, "error", str(e))
            finally:
                self.busy_since = None

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
            speech = np.array([c.slot if c.speech_due is not None else sink for c, *_ in batch], dtype=np.int64)
        if depth == 2:   # the forced token goes with its frame's text half
            text = np.array([c.slot if c.text_due is not None else sink for c, *_ in batch], dtype=np.int64)
            forced = np.array([c.text_due.forced if c.text_due is not None else -1 for c, *_ in batch],
                              dtype=np.int64)
        else:
            forced = np.array([f for *_, f in batch], dtype=np.int64)
        if self.pages is not None:
            with self.pages.writes_together():
                for call, *_ in batch:
                    self.pages.before_step(call)
        sampling = not all(call.options.sampling.greedy for call, *_ in batch)
        self.busy_since = time.monotonic()
        try:
            host = self.step_runner.step_to_host(slots, audio, forced, sampling, speech, text)  # numpy in and out
        finally:
            self.busy_since = None
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
                due, call.speech_due = call.speech_due, None
                hand_out(call, due, i)
            heard = None
            if frame_audio is not None:
                heard = InFlight(call.frames_stepped, ready, sent, [t for t in user[i] if t >= 0], forced_i)
                call.frames_stepped += 1
            if depth == 2:   # the text half ran last step's frame; the new one waits for its own
                spoken, call.text_due = call.text_due, heard
            else:
                spoken = heard
            if spoken is None:
                continue
            spoken.text, spoken.func, spoken.top2, spoken.stepped_at = text_out[i], func[i], tuple(top2[i]), sent
            if depth >= 1:
                call.speech_due = spoken
                continue
            hand_out(call, spoken, i)
        done = time.perf_counter()
        self._last_step = (started, done - t0)
        self._step_seconds[n] = done - t0
        self.stats.record_step(n, done - t0, gather=t0 - gathered, prep=launched - t0, device=waited - launched,
                               dispatch=done - waited, padded=host.padded_rows)
        with self.step_ended:
            self.step_ended.notify_all()

    def _free_slot(self, slot: int) -> None:
        if self.pages is not None:
            self.pages.release(slot)
        self.slots.give(slot)

    def _end(self, call: Call, reason: str, message: str = "") -> None:
        with self._lock:
            if self._calls.pop(call.id, None) is None:
                return
        call.closed = True
        if not call.in_admission:
            self._free_slot(call.slot)
        # else the admission thread may still be writing its rows: _take_admitted gives the slot back
        try:
            call.on_event(EndedEvent(call.id, reason, message))
        except Exception:
            traceback.print_exc()

