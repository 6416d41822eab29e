"""Admissions off the engine thread (engine.admission_thread): the thread, and the cohorts of calls it
admits together."""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch

if TYPE_CHECKING:
    from nemo_duplex.serving.calls import Call
    from nemo_duplex.serving.engine import Engine


@dataclass
class Job:
    call: Call
    pieces: Iterator                      # the admission, a piece per next() (frame_step.admission)
    key: tuple                            # what the prefix cache knows its result by (frame_step.admission_key)
    after: torch.cuda.Event | None        # the engine stream's work queued when it was submitted


class Cohort:
    """The calls the engine submitted to the admission thread in one tick."""

    def __init__(self):
        self.pending = 0
        self.last_done = time.monotonic()


def held_for_cohort(call: Call, now: float, coalesce_s: float) -> bool:
    """With the admission thread: a call admitted together with others (the same tick) holds its first
    frame until they are all admitted, so calls that open together share their first step as they do on the
    engine thread; bounded by engine.coalesce_ms (coalesce_s) after the last of them came back."""
    cohort = call.cohort
    return (cohort is not None and call.frames_stepped == 0 and cohort.pending > 0
            and now - cohort.last_done < coalesce_s)


class Admitter:
    """Admissions off the engine thread (engine.admission_thread): a worker thread runs each new call's
    admission (prompt prefill, talker warm-up) whole, on CUDA on a stream of its own, while the engine thread
    steps the live calls; a finished call joins the next step. The slot being admitted is in no step's batch
    until then, and its previous call's last step finished before its place was given back (a step ends
    with its outputs on the host), and a call that ends while here keeps its slot until the thread is done
    with it (Engine._end), so the two threads never touch the same rows. The admission's kernels
    start after the engine stream's work queued when it was submitted, and the call is handed back only once
    they are done. Host time of a 500-token admission on the H200 is ~0.2-0.3 s (docs/performance.md):
    on the engine thread it stalled every live call that long. Each time it takes work it takes every call
    queued by then: those the prefix cache admits are admitted together at once (Engine.restore_together),
    the others one by one, in order, each after the cached calls queued before it is done."""

    def __init__(self, engine: Engine):
        import queue

        self.engine = engine
        self.device = engine.model.stt_model.embed_tokens.weight.device   # (as build_engine finds it)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done: deque[tuple[Call, BaseException | None]] = deque()
        # the lowest priority (0); the engine thread steps on the highest (Engine._step_stream)
        self.stream = torch.cuda.Stream(self.device, priority=0) if self.device.type == "cuda" else None
        self.thread: threading.Thread | None = None
        self.busy_since: float | None = None   # when the thread took the call it is admitting (None: idle)
        self.gap_wait_s = engine.cfg.admission_gap_wait_ms / 1e3
        self.first_piece_s = 0.0   # how long the last admission's first piece took: the estimate for the next
        self.pieces = {"gap": 0, "waited": 0}   # pieces started in a gap / after waiting admission_gap_wait_ms

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="admission", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join(timeout=30)

    def submit(self, call: Call, pieces: Iterator, key: tuple) -> None:
        """Admit `call`: run `pieces` (frame_step.admission), or, where the prefix cache holds `key`
        (frame_step.admission_key), copy its entry in together with the other such calls queued by then."""
        after = None
        if self.stream is not None:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        self.jobs.put(Job(call, pieces, key, after))

    def _run(self) -> None:
        if self.stream is not None:
            torch.cuda.set_device(self.device)
        waiting: deque[Job] = deque()   # calls to admit one by one, oldest first
        stopping = False
        while waiting or not stopping:
            jobs = [] if waiting or stopping else [self.jobs.get()]
            while not self.jobs.empty():   # the calls submitted meanwhile: a burst of callers comes in together
                jobs.append(self.jobs.get())
            if None in jobs:   # stop(): the calls submitted before it are still admitted
                stopping = True
                jobs = jobs[:jobs.index(None)]
            cache = self.engine.prefix_cache
            restorable: dict[tuple, list[Job]] = {}
            for job in jobs:
                if not job.call.closed and job.key in cache:
                    restorable.setdefault(job.key, []).append(job)
                else:
                    waiting.append(job)
            for key, group in restorable.items():   # a copy for all of them, done in moments
                self._admit(group, self.engine.restore_together, key, [job.call for job in group])
            if waiting:   # then one other call; calls the cache admits never wait behind more than one
                job = waiting.popleft()
                self._admit([job], self._run_pieces, job.pieces)

    def _admit(self, jobs: list[Job], run: Callable, *args) -> None:
        """run(*args), the admission of `jobs`, on the admission's stream after the engine's work queued when
        each was submitted (not at all when every one of them has ended meanwhile); hand them back once its
        kernels are done, or with the error it raised."""
        error = None
        if not all(job.call.closed for job in jobs):
            self.busy_since = time.monotonic()
            try:
                with torch.no_grad(), (torch.cuda.stream(self.stream) if self.stream is not None
                                       else contextlib.nullcontext()):
                    for job in jobs:
                        if job.after is not None:
                            self.stream.wait_event(job.after)
                    run(*args)
                if self.stream is not None:
                    self.stream.synchronize()
            except Exception as e:  # noqa: BLE001 - the calls end with it; the thread goes on
                error = e
            self.busy_since = None
        self.done.extend((job.call, error) for job in jobs)
        self.engine.wake()

    def _run_pieces(self, pieces: Iterator) -> None:
        """The pieces of one admission, each started where `_await_gap` says it fits, each done (its kernels
        too) before the next one is considered. A piece is estimated to take what the one before it took
        (pieces fall in size: frame_step.prompt_pieces), the first what the last admission's first took."""
        estimate, first = self.first_piece_s, True
        while True:
            self._await_gap(estimate)
            started = time.perf_counter()
            try:
                next(pieces)
            except StopIteration:
                return
            if self.stream is not None:
                self.stream.synchronize()
            estimate = time.perf_counter() - started
            if first:
                self.first_piece_s, first = estimate, False

    def _await_gap(self, estimate: float) -> None:
        """Wait until the live calls' next step is due at least `estimate` seconds from now and none is under
        way (Engine.step_gap), looking again as each step ends; at most engine.admission_gap_wait_ms."""
        if self.gap_wait_s <= 0:
            return
        end = time.monotonic() + self.gap_wait_s
        while True:
            seen = self.engine.stats.steps
            if self.engine.step_gap() >= estimate:
                self.pieces["gap"] += 1
                return
            left = end - time.monotonic()
            if left <= 0:
                self.pieces["waited"] += 1
                return
            with self.engine.step_ended:
                self.engine.step_ended.wait_for(lambda: self.engine.stats.steps != seen, timeout=left)
