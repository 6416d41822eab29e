"""Prometheus metrics of one server: its own registry (no process globals), filled from the event loop.

Engine-side numbers (step times, frames) are read from `EngineStats` when sampled, so the engine thread
never touches a Prometheus object; per-frame lag is observed on the loop as each frame is sent.
"""
from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Lag of a frame: from the arrival of its last input sample to its packet being handed to the socket.
LAG_BUCKETS = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.16, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.5, 1.0)


class ServerMetrics:
    def __init__(self, deadline_s: float, fps_window_s: float = 5.0):
        self.registry = CollectorRegistry()
        r = self.registry
        self.deadline_s = deadline_s
        self.active_calls = Gauge("duplex_active_calls", "calls holding an engine slot", registry=r)
        self.sessions = Gauge("duplex_sessions", "connected sessions (with or without audio yet)", registry=r)
        self.connections = Gauge("duplex_connections", "open call connections (serve.max_connections)", registry=r)
        self.frames_per_second = Gauge("duplex_frames_per_second", "frames stepped per second, all calls",
                                       registry=r)
        self.frames = Counter("duplex_frames", "frames stepped by the engine", registry=r)
        self.steps = Counter("duplex_steps", "batched engine steps", registry=r)
        self.step_seconds = Histogram("duplex_step_seconds", "wall time of one batched frame step",
                                      buckets=STEP_BUCKETS, registry=r)
        self.step_phase = {phase: Counter(f"duplex_step_{phase}_seconds", help_, registry=r) for phase, help_ in (
            ("gather", "taking the calls' pending frames before a step (sum)"),
            ("prep", "engine host work per step, frames taken -> step launched (sum)"),
            ("device", "waiting for the device per step (sum)"),
            ("dispatch", "handing a step's frames out (sum)"))}
        self.padded_rows = Counter("duplex_padded_rows", "rows stepped including capture-bucket padding",
                                   registry=r)
        self._seen_phase = {"gather": 0.0, "prep": 0.0, "device": 0.0, "dispatch": 0.0, "padded": 0}
        self.batch_size = Gauge("duplex_last_batch_size", "calls in the last batched step", registry=r)
        self.frame_lag = Histogram("duplex_frame_lag_seconds", "last input sample of a frame -> its packet sent",
                                   buckets=LAG_BUCKETS, registry=r)
        self.deadline_misses = Counter("duplex_deadline_misses", "frames whose lag exceeded serve.deadline_ms",
                                       registry=r)
        self.refusals = Counter("duplex_refusals", "refused or failed requests by reason", ["reason"], registry=r)
        self.calls_ended = Counter("duplex_calls_ended", "calls ended, by reason", ["reason"], registry=r)
        self.connection_resets = Counter("duplex_connection_resets", "connections reset before their request "
                                         "(stage request) or WebSocket upgrade (stage upgrade) completed",
                                         ["stage"], registry=r)
        self.resumes = Counter("duplex_resumes", "WebSocket calls whose lost connection was taken over by a new one "
                               "(outcome resumed) or not within serve.resume_grace_s (expired)", ["outcome"], registry=r)
        self.parked_calls = Gauge("duplex_parked_calls", "calls waiting for their client to reconnect", registry=r)
        self.ready = Gauge("duplex_ready", "1 once warm-up (and graph capture) is done", registry=r)
        self.kv_pages = Gauge("duplex_kv_pages", "KV pages of each pool (llm, talker): all of them, those free, and "
                              "those neither taken nor committed to a live call (new calls are admitted by these)",
                              ["pool", "state"], registry=r)
        self.stalled = Gauge("duplex_stalled_seconds", "how long the engine thread's step or admission piece (part "
                             "engine) or the admission thread's call (part admission) has been under way past "
                             "engine.max_step_s / engine.max_admission_s; 0: none", ["part"], registry=r)
        self.admission_pieces = Counter("duplex_admission_pieces", "admission pieces (prompt chunks, warm-ups) the "
                                        "admission thread started in a gap between steps (start gap) or after waiting "
                                        "engine.admission_gap_wait_ms for one (waited)", ["start"], registry=r)
        self._seen_pieces = {"gap": 0, "waited": 0}
        self._seen_steps = 0
        self._seen_frames = 0
        self._fps = deque()        # (monotonic time, engine frames so far)
        self._fps_window_s = fps_window_s

    def frame_sent(self, lag_s: float) -> None:
        self.frame_lag.observe(lag_s)
        if lag_s > self.deadline_s:
            self.deadline_misses.inc()

    def refusal(self, reason: str) -> None:
        self.refusals.labels(reason=reason).inc()

    def call_ended(self, reason: str) -> None:
        self.calls_ended.labels(reason=reason).inc()

    def sample_engine(self, engine, sessions: int) -> None:
        """Pull the engine's counters (called every second and at each scrape)."""
        stats = engine.stats
        self.active_calls.set(engine.active_calls)
        self.sessions.set(sessions)
        self.stalled.labels(part="engine").set(engine.engine_stalled_s)
        self.stalled.labels(part="admission").set(engine.admission_stalled_s)
        if engine.pages is not None:
            for key, value in engine.pages.usage().items():   # e.g. talker_pages_uncommitted
                pool, _, state = key.partition("_pages")
                self.kv_pages.labels(pool=pool, state=state.lstrip("_") or "total").set(value)
        if engine.admitter is not None:
            for start, count in engine.admitter.pieces.items():
                if count > self._seen_pieces[start]:
                    self.admission_pieces.labels(start=start).inc(count - self._seen_pieces[start])
                    self._seen_pieces[start] = count
        new_steps = stats.steps - self._seen_steps
        if new_steps > 0:
            recent = list(stats.step_seconds)[-min(new_steps, len(stats.step_seconds)):]
            for s in recent:
                self.step_seconds.observe(s)
            self.steps.inc(new_steps)
            self._seen_steps = stats.steps
            if stats.batch_sizes:
                self.batch_size.set(stats.batch_sizes[-1])
        for phase, counter in self.step_phase.items():
            total = getattr(stats, f"{phase}_seconds")
            if total > self._seen_phase[phase]:
                counter.inc(total - self._seen_phase[phase])
                self._seen_phase[phase] = total
        if stats.padded_rows > self._seen_phase["padded"]:
            self.padded_rows.inc(stats.padded_rows - self._seen_phase["padded"])
            self._seen_phase["padded"] = stats.padded_rows
        if stats.frames > self._seen_frames:
            self.frames.inc(stats.frames - self._seen_frames)
            self._seen_frames = stats.frames
        now = time.monotonic()
        self._fps.append((now, stats.frames))
        while len(self._fps) > 2 and now - self._fps[0][0] > self._fps_window_s:
            self._fps.popleft()
        (t0, f0), (t1, f1) = self._fps[0], self._fps[-1]
        self.frames_per_second.set((f1 - f0) / (t1 - t0) if t1 > t0 else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
