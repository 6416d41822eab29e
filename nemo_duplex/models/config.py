"""Structured configs: every dimension of the four parts, as dataclasses.

Field names follow the official checkpoint's `config.json` where one exists (MODEL_SPEC sections 2-6),
so `checkpoint.py` can map both ways without a rename table. The Hydra yaml files in `conf/model/`
fill these; a loaded checkpoint overrides them with what its own `config.json` says.
"""
from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

DTYPE_NAMES = ("fp32", "bf16", "fp16")
# A KV pool may also hold float8 e4m3 (`dtype.talker_kv: fp8`): values as they are, saturated at +-448
# (ops/kv_pages.py), upcast in the attention kernel.
KV_DTYPE_NAMES = (*DTYPE_NAMES, "fp8")
# The float8 weight products (dtype.llm_weights, dtype.talker_weights; nemo_duplex/models/fp8_weights.py)
WEIGHT_PRODUCTS = ("fp8", "fp8_weight_only")


def torch_dtype(name: str):
    """A dtype name (fp32, bf16, fp16; fp8 = float8 e4m3, for KV pools) -> the torch dtype. torch is imported
    here, so that the settings (nemo_duplex/settings.py) import in a fraction of a second: an app refuses bad
    settings that fast."""
    if name not in KV_DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(KV_DTYPE_NAMES)}")
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}[name]


@dataclass
class FrontendConfig:
    """Mel front end (spec 2.1). `variant`: "release" = reflect pad and N//160+1 columns (the
    release-era NeMo branch, default); "nemo3" = constant pad and N//160 columns (nemo-toolkit 3.0.0),
    spec 12.3."""
    sample_rate: int = 16000
    n_fft: int = 512
    win_length: int = 400
    hop_length: int = 160
    n_mels: int = 128
    preemph: float = 0.97
    log_zero_guard: float = 2.0 ** -24
    variant: str = "release"


@dataclass
class EncoderConfig:
    """Cache-aware FastConformer (spec 2.2-2.9)."""
    n_layers: int = 24
    d_model: int = 1024
    n_heads: int = 8
    ff_expansion_factor: int = 4
    conv_kernel_size: int = 9
    subsampling_conv_channels: int = 256
    subsampling_factor: int = 8
    att_context_left: int = 70
    att_context_right: int = 0
    output_dim: int = 4480  # perception.proj: d_model -> LLM width

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class RNNTConfig:
    """Auxiliary RNN-T head for the user transcript (spec 2.10). Absent in nemo-toolkit 3.0.0."""
    present: bool = True
    vocab_size: int = 1024  # blank id == vocab_size
    pred_hidden: int = 640
    pred_rnn_layers: int = 2
    joint_hidden: int = 640
    max_symbols_per_step: int = 10


@dataclass
class LLMConfig:
    """Nemotron-H backbone (spec 3.1). Pattern letters: M = Mamba-2, * = attention, - = MLP."""
    hidden_size: int = 4480
    vocab_size: int = 131072
    hybrid_override_pattern: str = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
    intermediate_size: int = 15680
    num_attention_heads: int = 40
    num_key_value_heads: int = 8
    head_dim: int = 128
    mamba_num_heads: int = 128
    mamba_head_dim: int = 80
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    layer_norm_epsilon: float = 1e-5
    use_function_head: bool = True

    @property
    def num_layers(self) -> int:
        return len(self.hybrid_override_pattern)

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:  # x | B | C channels that go through the depthwise conv
        return self.mamba_d_inner + 2 * self.n_groups * self.ssm_state_size

    def layer_indices(self, kind: str) -> list[int]:
        return [i for i, c in enumerate(self.hybrid_override_pattern) if c == kind]


@dataclass
class GemmaConfig:
    """Gemma3-text talker backbone (spec 4.1). Layer i is full attention iff (i+1) % pattern == 0."""
    hidden_size: int = 1152
    intermediate_size: int = 4608
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 72
    query_pre_attn_scalar: float = 256.0
    sliding_window: int = 7500
    sliding_window_pattern: int = 6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rms_norm_eps: float = 1e-6

    def is_full_attention(self, layer: int) -> bool:
        return (layer + 1) % self.sliding_window_pattern == 0


@dataclass
class CASConfig:
    """Char-aware subword encoder: a 1-layer T5Gemma encoder over the characters of a token (spec 4.2)."""
    hidden_size: int = 1152
    intermediate_size: int = 4608
    num_hidden_layers: int = 1
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 72
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = 50.0
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    num_chars: int = 256  # single-character tokens of the tokenizer; embed_tokens has num_chars + 1 rows


@dataclass
class MoGConfig:
    """Mixture-of-Gaussians head (spec 4.6)."""
    num_predictions: int = 1024
    low_rank: int = 64
    min_log_std: float = -4.0
    num_layers: int = 3
    intermediate_size: int = 4608
    eps: float = 1e-6


@dataclass
class TalkerConfig:
    """EAR-TTS talker (spec 4). Sampling values are the release ones (spec 4.7)."""
    backbone: GemmaConfig = field(default_factory=GemmaConfig)
    cas: CASConfig = field(default_factory=CASConfig)
    mog: MoGConfig = field(default_factory=MoGConfig)
    latent_size: int = 512
    num_quantizers: int = 31
    codebook_size: int = 1024
    exponent: float = 3.0
    num_iter: int = 8
    guidance_scale: float = 0.2
    top_p: float = 0.95
    top_k: int = 0  # > 0 selects top-k instead of top-p (spec 12.8: k=1 = argmax component)
    noise_scale: float = 0.001
    force_silence_on_eos: bool = True
    audio_prompt_duration: float = 3.0
    speaker: str = "Aria"

    def prompt_frames(self, target_sample_rate: int = 22050, samples_per_frame: int = 1764) -> int:
        return int(math.floor(self.audio_prompt_duration * target_sample_rate / samples_per_frame))

    def unmask_schedule(self) -> list[int]:
        """Codebooks newly filled at each of the num_iter iterations (spec 4.6): [0,0,0,1,1,3,4,22] at 31."""
        q, n = self.num_quantizers, self.num_iter
        masked = [math.ceil((1 - (i / n) ** self.exponent) ** (1 / self.exponent) * q) for i in range(n)] + [0]
        return [masked[i] - masked[i + 1] for i in range(n)]

    @property
    def speech_pad_code(self) -> int:  # control codes: pad = cb, eos = cb+1, bos = cb+2 (spec 6.3)
        return self.codebook_size


@dataclass
class CodecConfig:
    """RVQ-VAE codec (spec 5). prod(rates) * hop_length == wav_to_token_ratio."""
    base_hidden_size: int = 384
    channel_mult: list[int] = field(default_factory=lambda: [1, 2, 4])
    rates: list[int] = field(default_factory=lambda: [7, 7, 9])
    num_blocks: int = 3
    kernel_size: int = 7
    latent_size: int = 512
    n_fft: int = 16
    hop_length: int = 4
    num_quantizers: int = 31
    codebook_size: int = 1024
    wav_to_token_ratio: int = 1764
    # How the decoder's GEMMs (pointwise and transposed convs) run, resolved once at load (codec.codec_gemm,
    # which refuses other names): "ieee" (fp32 SGEMM), "tf32x3" (3xTF32 Triton GEMM, fp32-accurate;
    # "tf32x3w": the weight split beforehand, for decode_step once at load, RVQCodec.presplit_weights),
    # "fp16x3w" (three fp16 products of power-of-two-scaled halves, as accurate, weights split once the same
    # way), "bf16x3" (~1e-5 relative), or "auto": fp16x3w on CUDA (measured fastest, docs/performance.md),
    # ieee elsewhere. Not in config.json.
    gemm: str = "auto"


@dataclass
class TokenConfig:
    """Special ids the VoiceChat config overrides (spec 3.8); never use the stock eos 12 as a stop."""
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = 12
    bos_token: str = "<s>"
    eos_token: str = "</s>"
    pad_token: str = "<SPECIAL_12>"
    tool_call_start: str = "<SPECIAL_20>"
    tool_call_end: str = "<SPECIAL_21>"
    tool_response_end: str = "<SPECIAL_22>"


@dataclass
class DtypeConfig:
    """Compute dtype per part. Reference numerics (spec 1.6) are fp32 everywhere; the codec is always fp32."""
    encoder: str = "fp32"
    llm: str = "fp32"
    talker: str = "fp32"
    codec: str = "fp32"
    mamba_ssm_state: str = "fp32"
    # The talker's KV pools (both CFG streams, every layer: 246 KiB per frame in bf16 at full size, most of a
    # call's memory): null keeps them in the talker's dtype; fp8 (e4m3, unscaled) halves them, at a
    # fidelity the gate's margins row reports (eval/margins.py: the codes that move).
    talker_kv: str | None = None
    # The LLM's Mamba and MLP projections (~7 of its ~9 billion parameters) and the talker backbone's
    # projections (~0.6 of its ~0.8): null keeps them in the part's dtype; both products store them in e4m3
    # with a scale per output row (nemo_duplex/models/fp8_weights.py): `fp8` quantises each call's rows too
    # and multiplies on FP8 tensor cores; `fp8_weight_only` keeps x in the part's bf16/fp16 and widens the
    # weights in registers. Each at a fidelity the gate's margins row measures.
    llm_weights: str | None = None
    talker_weights: str | None = None

    def __post_init__(self):
        for name in ("encoder", "llm", "talker", "codec", "mamba_ssm_state"):
            if getattr(self, name) not in DTYPE_NAMES:
                raise ValueError(f"dtype.{name}: unknown dtype {getattr(self, name)!r}; expected one of "
                                 f"{sorted(DTYPE_NAMES)}")
        if self.talker_kv is not None and self.talker_kv not in KV_DTYPE_NAMES:
            raise ValueError(f"dtype.talker_kv: unknown dtype {self.talker_kv!r}; expected null or one of "
                             f"{sorted(KV_DTYPE_NAMES)}")
        for name, part in (("llm_weights", "llm"), ("talker_weights", "talker")):
            product = getattr(self, name)
            if product not in (None, *WEIGHT_PRODUCTS):
                raise ValueError(f"dtype.{name}: {product!r}; expected null (the {part}'s dtype) or one of "
                                 f"{list(WEIGHT_PRODUCTS)}")
            if product == "fp8_weight_only" and getattr(self, part) not in ("bf16", "fp16"):
                raise ValueError(f"dtype.{name}=fp8_weight_only widens the weights to the {part}'s dtype on the "
                                 f"tensor cores: dtype.{part} must be bf16 or fp16, not {getattr(self, part)}")
        if self.codec != "fp32":
            raise ValueError("dtype.codec must be fp32: the codec collapses in bf16 (spec 9.9)")

    @property
    def talker_kv_pool(self) -> str:
        """The talker KV pools' dtype name: talker_kv, or the talker's own."""
        return self.talker_kv or self.talker


@dataclass
class SamplingParams:
    """A call's agent-text sampling (nemo_duplex/models/sampling.py applies it): temperature 0 = greedy, the reference."""
    temperature: float = 0.0
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or (
            self.top_p >= 1.0 and self.repetition_penalty == 1.0 and self.temperature in (0.0, 1.0))


@dataclass
class ModelConfig:
    """The release model's dimensions (spec 1-6); conf/model/ presets override them. With a checkpoint, its
    config.json supplies the architecture and the default generation settings (nemo_duplex/runtime.py)."""
    name: str = "nemotron_duplex"
    weights: str = "checkpoint"  # "checkpoint" (load `checkpoint=`) or "random" (speed measurements only)
    # what `checkpoint=` defaults to for this preset: a repo id or directory, or "embedded" (the tiny preset:
    # the seeded random checkpoint written once under outputs/checkpoints/)
    default_checkpoint: str = "nvidia/NVIDIA-NemotronLabs-VoiceChat-11B"
    frontend: FrontendConfig = field(default_factory=FrontendConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    rnnt: RNNTConfig = field(default_factory=RNNTConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    talker: TalkerConfig = field(default_factory=TalkerConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    tokens: TokenConfig = field(default_factory=TokenConfig)
    dtype: DtypeConfig = field(default_factory=DtypeConfig)
    user_channel_weight: float = 1.0
    text_channel_weight: float = 1.0
    function_channel_weight: float = 2.0
    source_sample_rate: int = 16000
    target_sample_rate: int = 22050
    frame_length: float = 0.08
    pretrained_llm: str = "nvidia/NVIDIA-Nemotron-Nano-9B-v2"

    @property
    def samples_per_frame_in(self) -> int:  # 1280
        return round(self.source_sample_rate * self.frame_length)

    @property
    def samples_per_frame_out(self) -> int:  # 1764
        return self.codec.wav_to_token_ratio

    @property
    def prompt_frames(self) -> int:  # 37 speaker warm-up positions
        return self.talker.prompt_frames(self.target_sample_rate, self.samples_per_frame_out)


CONF = Path(__file__).resolve().parents[2] / "conf"


def preset(name: str) -> ModelConfig:
    """A model preset of conf/model/ (its YAML over ModelConfig's defaults, which are the release model's),
    without Hydra: what `model=<name>` composes. A key the dataclasses do not have is an error."""
    return copy.deepcopy(_preset(name))


@functools.cache
def _preset(name: str) -> ModelConfig:
    from omegaconf import OmegaConf

    path = CONF / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"no model preset {name!r}: {path} does not exist "
                         f"(presets: {sorted(p.stem for p in (CONF / 'model').glob('*.yaml'))})")
    values = OmegaConf.load(path)
    values.pop("defaults", None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), values))


def tiny_config() -> ModelConfig:
    """The embedded tiny configuration (conf/model/nemotron_duplex_tiny.yaml): every kind of layer, small dims."""
    return preset("nemotron_duplex_tiny")
