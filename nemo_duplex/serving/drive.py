"""The engine driven as clients would drive it, on the calling thread: `drive` opens each planned call at
its tick, feeds it live (appends of `chunk` samples, about a frame's worth per tick) or as an upload (the
whole clip at once), ticks the engine until every call ended, and returns what each call produced as a
ClipResult, the type the offline and streaming loops return. scripts/run_clip.py (mode=engine), the
gate's rows and the tests use it; the server drives the engine from its own thread instead."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from graphs.capture import HostStepper
from nemo_duplex.models.config import SamplingParams
from nemo_duplex.models.model import ClipResult
from nemo_duplex.serving.calls import CallOptions, EndedEvent, FrameEvent


@dataclass
class CallPlan:
    """One call through the engine."""
    audio: torch.Tensor      # [N] float32 at 16 kHz
    start: int = 0           # the tick at which the call opens
    chunk: int = 1280        # samples per append by a live client
    upload: bool = False     # the whole clip in one append, then end of input
    seed: int = 0
    prompt: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    appends_per_tick: int | None = None  # None: as many as make one 1280-sample frame per tick

    def appends(self, frame: int) -> int:
        return self.appends_per_tick or -(-frame // self.chunk)


def clip_plans(clips: list[torch.Tensor], offsets: list[int] | None = None, prompt: str | None = None,
               seed: int = 0, sampling: SamplingParams | None = None,
               uploads: list[bool] | None = None) -> list[CallPlan]:
    """Clip i opens at tick offsets[i] with seed seed + i, live one frame per tick, or as an upload."""
    offsets = offsets or [0] * len(clips)
    uploads = uploads or [False] * len(clips)
    if not (len(offsets) == len(uploads) == len(clips)):
        raise ValueError(f"{len(clips)} clips, {len(offsets)} offsets, {len(uploads)} upload flags")
    return [CallPlan(c, start=o, upload=u, seed=seed + i, prompt=prompt, sampling=sampling or SamplingParams())
            for i, (c, o, u) in enumerate(zip(clips, offsets, uploads))]


class EncoderRecorder(HostStepper):
    """Wraps an engine's step runner and keeps the encoder frames each slot produced (a FrameEvent carries
    no encoder output). Frames are handed over per slot when its call ends."""

    def __init__(self, runner):
        self.runner, self.host_fields = runner, runner.host_fields
        self.frames: dict[int, list[torch.Tensor]] = defaultdict(list)

    def __call__(self, slots: torch.Tensor, audio: torch.Tensor, forced: torch.Tensor, sampling: bool = True,
                 speech=None, text=None):
        out = self.runner(slots, audio, forced, sampling, speech, text)
        enc = out.enc.float().cpu()
        for row, slot in enumerate(slots.tolist()):
            self.frames[slot].append(enc[row])
        return out

    def take(self, slot: int) -> torch.Tensor:
        frames = self.frames.pop(slot, [])
        return torch.stack(frames) if frames else torch.empty(0)


@torch.no_grad()
def drive(engine, plans: list[CallPlan], record_encoder: bool = False, at_once: int | None = None) -> list[ClipResult]:
    """Every planned call through `engine`, one tick at a time; each must end "completed" (else
    RuntimeError naming why). `record_encoder`: also each call's encoder frames (ClipResult.encoder_out).
    `at_once`: the plans in groups of at most that many (an engine's slots), each group to its end in turn."""
    if at_once is not None and len(plans) > at_once:
        return [rec for i in range(0, len(plans), at_once)
                for rec in drive(engine, plans[i: i + at_once], record_encoder)]
    recorder = EncoderRecorder(engine.step_runner) if record_encoder else None
    if recorder is not None:
        engine.step_runner = recorder
    events: list[list] = [[] for _ in plans]
    encoders: dict[int, torch.Tensor] = {}
    calls: dict[int, object] = {}
    fed = [0] * len(plans)

    def listener(i: int):
        def on_event(ev):
            events[i].append(ev)
            if isinstance(ev, EndedEvent) and recorder is not None:
                encoders[i] = recorder.take(calls[i].slot)
        return on_event

    # A call needs at most its start + its appends + one tick per frame (+ the pipeline's depth); twice the
    # longest is a hang.
    n = engine.frame_samples
    longest = max(p.start + -(-p.audio.shape[0] // (p.chunk * p.appends(n))) + -(-p.audio.shape[0] // n) + 4
                  for p in plans)
    tick = 0
    try:
        while len(calls) < len(plans) or not all(c.closed for c in calls.values()):
            for i, plan in enumerate(plans):
                if i not in calls and tick >= plan.start:
                    options = CallOptions(prompt=plan.prompt, seed=plan.seed, sampling=plan.sampling)
                    calls[i] = engine.open_call(options, on_event=listener(i))
                    if plan.upload:
                        calls[i].append(plan.audio.numpy())
                        calls[i].end_input()
                        fed[i] = plan.audio.shape[0]
                for _ in range(plan.appends(n) if i in calls else 0):
                    if fed[i] >= plan.audio.shape[0]:
                        break
                    calls[i].append(plan.audio[fed[i]: fed[i] + plan.chunk].numpy())
                    fed[i] += plan.chunk
                    if fed[i] >= plan.audio.shape[0]:
                        calls[i].end_input()
            engine.tick()
            tick += 1
            if tick > 2 * longest:
                raise RuntimeError(f"the engine did not finish {len(plans)} calls within {tick} ticks")
    finally:
        if recorder is not None:
            engine.step_runner = recorder.runner
    return [_result(i, evs, encoders.get(i)) for i, evs in enumerate(events)]


def _result(i: int, evs: list, enc: torch.Tensor | None) -> ClipResult:
    ended = [e for e in evs if isinstance(e, EndedEvent)]
    if not ended or ended[-1].reason != "completed":
        why = f"{ended[-1].reason}: {ended[-1].message}" if ended else "no end event"
        raise RuntimeError(f"engine call {i} did not complete ({why})")
    frames = [e for e in evs if isinstance(e, FrameEvent)]
    return ClipResult(
        encoder_out=enc if enc is not None else torch.empty(0), audio_embeds=torch.empty(0),
        text_tokens=torch.tensor([f.text for f in frames], dtype=torch.int64),
        function_tokens=torch.tensor([f.func for f in frames], dtype=torch.int64),
        text_logits_top2=torch.tensor([f.top2 for f in frames], dtype=torch.float32).reshape(-1, 2),
        codes=torch.from_numpy(np.stack([f.codes for f in frames])) if frames else torch.empty(0, dtype=torch.int64),
        wav=torch.from_numpy(np.concatenate([f.pcm for f in frames])) if frames else torch.empty(0),
        user_tokens=[t for f in frames for t in f.user])
