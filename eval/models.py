"""The models the gate's model rows run, and the ways of running a clip through them.

- `ModelSet`: the fp32 yardstick (every part fp32, spec 1.6: the reference numerics), the bf16 variant
  (the deployment dtypes, codec fp32 always: spec 9.9) and the model as configured.
- `clip_audio`: a clip as the model hears it (16 kHz, cropped to whole 80 ms frames so that offline
  and streaming see the same samples: a partial last chunk is zero-padded by the streaming paths).
- `make_engine`: an engine sized for a row's calls (nemo_duplex/serving/drive.py drives it).
- comparisons: per-frame cosine / relative error, first differing frame.
"""
from __future__ import annotations

import copy
import dataclasses
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
    return all(getattr(d, k) == "fp32" for k in FP32) and d.talker_kv_pool == "fp32"


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
# The engine


def make_engine(model, tokenizer, max_calls: int, seconds: float, graphs: bool = False,
                graph_backend: str | None = None):
    """An engine sized for `max_calls` calls of at most `seconds` of input, graphs captured if asked (with
    `graph_backend`, the server's default unless named)."""
    from nemo_duplex.serving.engine import build_engine
    from nemo_duplex.settings import EngineConfig

    graph_backend = graph_backend or EngineConfig.graph_backend
    # from 2, as the server's (nemo_duplex/settings.py CAPTURE_BUCKETS): 1 would be a build of its own
    buckets = [b for b in (2, 4, 8, 16, 32, 64, 128) if b < max_calls] + [max_calls]
    engine = build_engine(model, tokenizer, EngineConfig(max_calls=max_calls, max_call_s=seconds + 1.0,
                                                         max_pending_s=seconds + 1.0, capture_buckets=buckets,
                                                         graphs=graphs, graph_backend=graph_backend))
    engine.prepare()
    return engine


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
