"""The models the gate's model rows run, and the ways of running a clip through them.

- `ModelSet`: the fp32 yardstick (every part fp32, spec 1.6: the reference numerics), the bf16 variant
  (the deployment dtypes, codec fp32 always: spec 9.9) and the model as configured.
- `clip_audio`: a clip as the model hears it (16 kHz, cropped to whole 80 ms frames so that offline
  and streaming see the same samples: a partial last chunk is zero-padded by the streaming paths).
- `drive_engine`: calls through the engine's client API (`open_call`, `append`, `end_input`, `tick`),
  each with its own start tick, append size (live) or upload, exactly as a server would feed it.
- comparisons: per-frame cosine / relative error, first differing frame.
"""
from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from eval.audio import resample
from eval.clips.make_clips import Clip

FP32 = {"encoder": "fp32", "llm": "fp32", "talker": "fp32", "codec": "fp32", "mamba_ssm_state": "fp32"}


# ---------------------------------------------------------------------------------------------------
# Models


def with_dtypes(model, dtype):
    """A copy of `model` whose parts compute in `dtype` (a DtypeConfig); `model` is left as it is."""
    twin = copy.deepcopy(model)
    twin.cfg = dataclasses.replace(model.cfg, dtype=dtype)
    return twin.cast_for_inference().eval()


@dataclass
class ModelSet:
    fp32: object             # VoiceChat, every part fp32: the yardstick
    bf16: object             # VoiceChat in the bf16 deployment dtypes (codec fp32)
    configured: object       # VoiceChat in the dtypes of the model config (may be one of the two above)
    tokenizer: object
    rnnt_vocab: object | None

    @property
    def device(self) -> torch.device:
        return self.fp32.stt_model.embed_tokens.weight.device

    @staticmethod
    def from_fp32(fp32, tokenizer, rnnt_vocab, bf16_dtype: dict, configured_dtype: dict | None = None) -> "ModelSet":
        """The set around an fp32 model: the bf16 variant is a cast copy; the configured model is the fp32
        or the bf16 one when its dtypes are theirs, else another cast copy."""
        from nemo_duplex.models.config import DtypeConfig

        bf16_cfg = DtypeConfig(**{**FP32, **dict(bf16_dtype)})
        wanted = DtypeConfig(**{**FP32, **dict(configured_dtype or {})})
        bf16 = with_dtypes(fp32, bf16_cfg)
        if wanted == DtypeConfig(**FP32):
            configured = fp32
        elif wanted == bf16_cfg:
            configured = bf16
        else:
            configured = with_dtypes(fp32, wanted)
        return ModelSet(fp32=fp32, bf16=bf16, configured=configured, tokenizer=tokenizer, rnnt_vocab=rnnt_vocab)


def load_model_set(cfg, bf16_dtype: dict, resolved=None) -> ModelSet:
    """Load the configured checkpoint (runtime.load; `resolved` when the caller resolved it already) in
    fp32, whatever the config's dtypes: the yardstick must come from the checkpoint's own fp32 weights,
    not from a bf16 round trip."""
    from nemo_duplex import runtime
    from nemo_duplex.models.config import DtypeConfig

    resolved = resolved or runtime.resolve_model(cfg)
    configured_dtype = dataclasses.asdict(resolved.cfg.dtype)
    fp32_only = dataclasses.replace(resolved, cfg=dataclasses.replace(resolved.cfg, dtype=DtypeConfig()))
    fp32, tokenizer, rnnt_vocab, _ = runtime.load(cfg, resolved=fp32_only)
    return ModelSet.from_fp32(fp32, tokenizer, rnnt_vocab, bf16_dtype, configured_dtype)


def ieee_fp32() -> None:
    """fp32 matmuls and convolutions in IEEE fp32 on CUDA for the rest of the process (cuDNN convolutions
    default to TF32): the fp32 yardstick is fp32 (spec 1.6), and the rows' fp32 bounds are set for it.
    Call before any graph is compiled (the flags are read at compile time)."""
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"


def is_all_fp32(model) -> bool:
    d = model.cfg.dtype
    return all(getattr(d, k) == "fp32" for k in FP32)


# ---------------------------------------------------------------------------------------------------
# Clips


def clip_audio(clip: Clip, model_cfg, max_seconds: float | None = None) -> torch.Tensor:
    """The clip at the model's input rate, cut to `max_seconds` and then down to whole frames
    (1280 samples), float32 [N]."""
    wav, sr = clip.load()
    rate, frame = model_cfg.source_sample_rate, model_cfg.samples_per_frame_in
    if sr != rate:
        wav = resample(wav, sr, rate)
    if max_seconds is not None:
        wav = wav[: int(round(max_seconds * rate))]
    frames = len(wav) // frame
    if frames < 1:
        raise ValueError(f"clip {clip.name} is shorter than one {frame}-sample frame")
    return torch.from_numpy(np.ascontiguousarray(wav[: frames * frame], dtype=np.float32))


@torch.no_grad()
def offline_encoder(model, audio: torch.Tensor) -> torch.Tensor:
    """Offline perception encoder output [T, d_enc] in fp32 (T = K+1 for K whole frames, spec 2.8)."""
    dev = model.stt_model.embed_tokens.weight.device
    x = audio.to(dev, torch.float32)[None]
    enc, lengths = model.perception(x, torch.tensor([x.shape[1]], device=dev))
    return enc[0, : int(lengths[0])].float().cpu()


# ---------------------------------------------------------------------------------------------------
# The engine, driven as a client would


@dataclass
class CallPlan:
    """One call through the engine."""
    audio: torch.Tensor      # [N] float32 at 16 kHz
    start: int = 0           # the tick at which the call opens
    chunk: int = 1280        # samples per append by a live client
    upload: bool = False     # the whole clip in one append, then end of input
    seed: int = 0
    appends_per_tick: int | None = None  # None: as many as make one 1280-sample frame per tick

    def appends(self, frame: int) -> int:
        return self.appends_per_tick or -(-frame // self.chunk)


@dataclass
class CallRecord:
    """What one call produced, frame by frame."""
    text: torch.Tensor       # [K] int64
    func: torch.Tensor       # [K] int64
    top2: torch.Tensor       # [K, 2] top-1/top-2 text logits
    codes: torch.Tensor      # [K, Q] int64
    pcm: torch.Tensor        # [K * 1764] float32
    enc: torch.Tensor | None  # [K, d_enc] fp32 encoder frames (drive_engine(record_encoder=True))


class EncoderRecorder:
    """Wraps an engine's step runner and keeps the encoder frames each slot produced (a FrameEvent
    carries no encoder output). Frames are handed over per slot when its call ends."""

    def __init__(self, runner):
        self.runner = runner
        self.frames: dict[int, list[torch.Tensor]] = defaultdict(list)

    def __call__(self, slots: torch.Tensor, audio: torch.Tensor, forced: torch.Tensor):
        out = self.runner(slots, audio, forced)
        enc = out.enc.float().cpu()
        for row, slot in enumerate(slots.tolist()):
            self.frames[slot].append(enc[row])
        return out

    def take(self, slot: int) -> torch.Tensor:
        frames = self.frames.pop(slot, [])
        return torch.stack(frames) if frames else torch.empty(0)


def make_engine(model, tokenizer, max_calls: int, seconds: float, graphs: bool = False,
                graph_backend: str = "reduce-overhead"):
    """An engine sized for `max_calls` calls of at most `seconds` of input, graphs captured if asked."""
    from nemo_duplex.serving.engine import Engine, EngineConfig

    buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < max_calls] + [max_calls]
    engine = Engine(model, tokenizer, EngineConfig(max_calls=max_calls, max_call_s=seconds + 1.0,
                                                   max_pending_s=seconds + 1.0, capture_buckets=buckets,
                                                   graphs=graphs, graph_backend=graph_backend))
    engine.prepare()
    return engine


@torch.no_grad()
def drive_engine(engine, plans: list[CallPlan], record_encoder: bool = False) -> list[CallRecord]:
    """Feed every planned call through `engine` on this thread, one tick at a time, and collect what each
    call produced. Calls open at their start tick; a live call appends `chunk` samples at a time (the
    engine regroups them into 1280-sample frames), by default about one frame's worth per tick; an
    upload appends the whole clip at once. Every call must end "completed"."""
    from nemo_duplex.serving.engine import CallOptions, EndedEvent, FrameEvent

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

    # A call needs at most its start + its appends + one tick per frame; twice the longest is a hang.
    n = engine.frame_samples
    longest = max(p.start + -(-p.audio.shape[0] // (p.chunk * p.appends(n))) + -(-p.audio.shape[0] // n) + 2
                  for p in plans)
    tick = 0
    try:
        while len(calls) < len(plans) or not all(c.closed for c in calls.values()):
            for i, plan in enumerate(plans):
                if i not in calls and tick >= plan.start:
                    calls[i] = engine.open_call(CallOptions(seed=plan.seed), on_event=listener(i))
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

    records = []
    for i, evs in enumerate(events):
        ended = [e for e in evs if isinstance(e, EndedEvent)]
        if not ended or ended[-1].reason != "completed":
            why = f"{ended[-1].reason}: {ended[-1].message}" if ended else "no end event"
            raise RuntimeError(f"engine call {i} did not complete ({why})")
        frames = [e for e in evs if isinstance(e, FrameEvent)]
        records.append(CallRecord(
            text=torch.tensor([f.text for f in frames], dtype=torch.int64),
            func=torch.tensor([f.func for f in frames], dtype=torch.int64),
            top2=torch.tensor([f.top2 for f in frames], dtype=torch.float32).reshape(-1, 2),
            codes=torch.from_numpy(np.stack([f.codes for f in frames])) if frames else torch.empty(0, dtype=torch.int64),
            pcm=torch.from_numpy(np.concatenate([f.pcm for f in frames])) if frames else torch.empty(0),
            enc=encoders.get(i)))
    return records


# ---------------------------------------------------------------------------------------------------
# Comparisons


class TopTwo:
    """Forward hook on a head (the function head: its margin is not among the step outputs) keeping
    the top-1/top-2 logit values of every call, [rows, 2] each, until `remove()`."""

    def __init__(self, head: torch.nn.Module):
        self.values: list[torch.Tensor] = []
        self.handle = head.register_forward_hook(self)

    def __call__(self, module, inputs, output):
        self.values.append(output.detach().float().topk(2, dim=-1).values.reshape(-1, 2).cpu())

    @property
    def last(self) -> torch.Tensor:
        return self.values[-1]

    def stacked(self) -> torch.Tensor:
        return torch.cat(self.values) if self.values else torch.empty(0, 2)

    def remove(self):
        self.handle.remove()


def frame_errors(x: torch.Tensor, ref: torch.Tensor) -> dict[str, torch.Tensor | float]:
    """x, ref [K, d] -> per-frame cosine and relative error ||x - ref|| / ||ref|| ([K] each), and the
    whole clip's relative error (Frobenius norms)."""
    x, ref = x.double(), ref.double()
    diff = (x - ref).norm(dim=-1)
    cosine = torch.nn.functional.cosine_similarity(x, ref, dim=-1)
    rel = diff / ref.norm(dim=-1).clamp_min(1e-30)
    return {"cosine": cosine.float(), "rel": rel.float(),
            "clip_rel": float((x - ref).norm() / ref.norm().clamp_min(1e-30))}


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The first index where a and b (same length, any trailing shape) differ, None if equal."""
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"cannot compare {a.shape[0]} frames with {b.shape[0]}")
    same = (a == b).reshape(a.shape[0], -1).all(dim=1)
    bad = (~same).nonzero()
    return int(bad[0]) if bad.numel() else None


def margin(top2: torch.Tensor, frame: int) -> float:
    """The top-1 minus top-2 logit at `frame` of a [K, 2] top-2 table."""
    return float(top2[frame, 0] - top2[frame, 1])
