"""Memory planning: what one call costs on the device, from the config alone, and whether the model (and a
server of `engine.max_calls` calls of up to `engine.max_call_s` seconds) fits, CPU included.

Nothing here allocates device memory. The per-call bytes restate `state.allocate_call_state` as
formulas, one per pool, so they can be read, tabulated and checked before any weights load
(tests/test_memory.py checks them against a real allocation of the tiny model). The weights are counted
on a model built on the `meta` device. What the formulas cannot know (activations of the largest
capture bucket, CUDA graph pools, the CUDA context, allocator slack) is a fixed reserve, `memory.reserve_gib`.

    python -m nemo_duplex.serving.memory          # the docs/performance.md table at full size (bf16, fp32 SSM state)
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from nemo_duplex.models.config import ModelConfig, torch_dtype
from nemo_duplex.serving.state import KVPageCounts

GiB = 2 ** 30
INT64, FLOAT32, BOOL = 8, 4, 1
DEFAULT_RESERVE_BYTES = 6 * GiB  # measured on the H200: 5.2 GiB beyond the plan at 160 calls (docs/performance.md)


def dtype_bytes(name: str) -> int:
    return torch.empty(0, dtype=torch_dtype(name)).element_size()


@dataclass
class CallBytes:
    """Bytes one call holds in the state pools (one slot row of each pool), by component."""
    mamba_ssm: int        # Mamba-2 SSM state [heads, head_dim, d_state] per Mamba layer (spec 3.3), fp32 by default
    mamba_conv: int       # Mamba-2 depthwise-conv tail: the last K-1 xBC columns per Mamba layer
    llm_kv: int           # NoPE attention K and V for prompt + every frame of the call (spec 3.4)
    talker_kv: int        # Gemma3 K and V, cond and uncond streams (CFG, spec 4.5), speaker prompt + frames
    encoder_window: int   # FastConformer K and V of the last att_context_left frames per layer (spec 2.7)
    encoder_other: int    # raw-audio and mel tails, conv-module caches, frame counter
    rnnt: int             # RNN-T prediction-net LSTM state and last token (spec 2.10)
    codec: int            # decoder ConvNeXt histories, iSTFT overlap-add tails (spec 5)
    scalars: int          # positions, previous tokens and codes, sampling settings, seen-token mask

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    @property
    def slot_without_kv(self) -> int:
        """A slot row when the KV is in a pool of its own (engine.kv_pool_gib), not sized per call."""
        return self.total - self.llm_kv - self.talker_kv

    def by_pool(self) -> dict[str, int]:
        """Grouped as `CallState.nbytes_per_slot()` groups them (one entry per CallState field)."""
        return {"encoder": self.encoder_window + self.encoder_other, "rnnt": self.rnnt,
                "llm": self.mamba_ssm + self.mamba_conv + self.llm_kv, "talker": self.talker_kv,
                "codec": self.codec, "scalars": self.scalars}


def frames_per_call(cfg: ModelConfig, max_call_s: float) -> int:
    """The engine's `max_frames`: a call of max_call_s seconds is this many 80 ms frames."""
    return math.ceil(max_call_s / cfg.frame_length)


def bytes_per_call(cfg: ModelConfig, max_call_s: float, max_prompt_tokens: int = 512) -> CallBytes:
    """One slot row of every pool `allocate_call_state` makes, for calls of up to max_call_s seconds and
    system prompts of up to max_prompt_tokens tokens (the LLM KV holds both)."""
    d = cfg.dtype
    enc_b, llm_b, ssm_b = dtype_bytes(d.encoder), dtype_bytes(d.llm), dtype_bytes(d.mamba_ssm_state)
    frames = frames_per_call(cfg, max_call_s)

    llm = cfg.llm
    n_mamba = len(llm.layer_indices("M"))
    mamba_ssm = n_mamba * llm.mamba_num_heads * llm.mamba_head_dim * llm.ssm_state_size * ssm_b
    mamba_conv = n_mamba * llm.mamba_conv_dim * (llm.conv_kernel - 1) * llm_b
    llm_position, talker_position = kv_bytes_per_position(cfg)
    llm_kv = llm_position * (max_prompt_tokens + frames)
    talker_kv = talker_position * (cfg.prompt_frames + frames)

    enc, fe = cfg.encoder, cfg.frontend
    encoder_window = 2 * enc.n_layers * enc.att_context_left * enc.n_heads * enc.head_dim * enc_b
    # the streaming step's geometry (docs/design.md): 17 mel columns, 8 of them new per frame
    audio_tail = (enc.subsampling_factor - 1) * fe.hop_length + fe.n_fft // 2 + 1
    mel_tail = fe.n_mels * (17 - enc.subsampling_factor)
    encoder_other = (audio_tail + mel_tail) * FLOAT32 + INT64 \
        + enc.n_layers * enc.d_model * (enc.conv_kernel_size - 1) * enc_b

    r = cfg.rnnt
    rnnt = (2 * r.pred_rnn_layers * r.pred_hidden * enc_b + INT64) if r.present else 0

    c = cfg.codec
    widths = [c.base_hidden_size * m for m in c.channel_mult]
    codec = sum(widths) * c.num_blocks * (c.kernel_size - 1) * FLOAT32 \
        + 2 * (c.n_fft - c.hop_length) * FLOAT32 + INT64

    q = cfg.talker.num_quantizers
    # llm_len, talker_pos, frame, speech_frame, pending_text, prev_text, prev_func, seed; the codes; the
    # sampling settings; the seen-token mask; the projected encoder frame awaiting its text (state.CallState)
    scalars = 8 * INT64 + q * INT64 + 3 * FLOAT32 + BOOL + llm.vocab_size * BOOL + llm.hidden_size * llm_b

    return CallBytes(mamba_ssm, mamba_conv, llm_kv, talker_kv, encoder_window, encoder_other, rnnt, codec,
                     scalars)


def kv_bytes_per_position(cfg: ModelConfig) -> tuple[int, int]:
    """(LLM, talker) KV bytes of one position of one call: the LLM's NoPE attention layers' K and V (spec
    3.4); the talker's Gemma3 K and V of both CFG streams (spec 4.5) in every layer (its sliding_window,
    7500, is longer than any call we allow, so every layer keeps the whole call)."""
    llm, tb = cfg.llm, cfg.talker.backbone
    n_attn = len(llm.layer_indices("*"))
    return (2 * n_attn * llm.num_key_value_heads * llm.head_dim * dtype_bytes(cfg.dtype.llm),
            2 * tb.num_hidden_layers * 2 * tb.num_key_value_heads * tb.head_dim * dtype_bytes(cfg.dtype.talker_kv_pool))


def kv_pages_per_call(cfg: ModelConfig, max_call_s: float, max_prompt_tokens: int, page_len: int) -> tuple[int, int]:
    """(LLM, talker) pages a call of up to max_call_s seconds may need (serving/pages.py commits them): a
    position for each prompt token (the talker: each warm-up frame) and each frame."""
    frames = frames_per_call(cfg, max_call_s)
    return (math.ceil((max_prompt_tokens + frames) / page_len), math.ceil((cfg.prompt_frames + frames) / page_len))


def kv_page_counts(cfg: ModelConfig, max_calls: int, max_call_s: float, max_prompt_tokens: int, page_len: int,
                   pool_gib: float | None = None) -> KVPageCounts:
    """The paged KV pools' sizes: pages for max_calls calls of max_call_s, or with pool_gib
    (engine.kv_pool_gib) as many pages as that many GiB hold, shared between the LLM and the talker in the
    proportion one call of max_call_s takes them."""
    if page_len < 16 or page_len & (page_len - 1):
        raise ValueError(f"engine.kv_page_len = {page_len}: a power of two (the kernels divide by it), at least 16 "
                         "(a block of keys lies in one page, and the LLM's attention kernel multiplies blocks of 16)")
    llm_call, talker_call = kv_pages_per_call(cfg, max_call_s, max_prompt_tokens, page_len)
    calls = float(max_calls)
    if pool_gib is not None:
        if not pool_gib > 0:
            raise ValueError(f"engine.kv_pool_gib = {pool_gib}: GiB of KV pages, > 0 (null: enough for every call "
                             "at engine.max_call_s)")
        llm_position, talker_position = kv_bytes_per_position(cfg)
        calls = pool_gib * GiB / (page_len * (llm_call * llm_position + talker_call * talker_position))
    return KVPageCounts(page_len, math.floor(calls * llm_call), math.floor(calls * talker_call))


def prefix_entry_bytes(cfg: ModelConfig, prompt_tokens: int = 512) -> int:
    """One entry of the engine's prefix cache (state.PrefixCache, sized in bytes by engine.prefix_cache_mib):
    the Mamba states after the prompt, the prompt's LLM K/V and the talker K/V of the speaker warm-up."""
    llm_only = bytes_per_call(cfg, 0.0, prompt_tokens)
    talker_warmup = bytes_per_call(cfg, 0.0, 0).talker_kv   # prompt_frames positions, both streams
    return llm_only.mamba_ssm + llm_only.mamba_conv + llm_only.llm_kv + talker_warmup


def weight_bytes(cfg: ModelConfig, max_token_chars: int = 1, device: str | torch.device = "cuda") -> int:
    """Parameters and buffers of the model cast to its inference dtypes, counted on the meta device, plus
    the tables derived from them on `device` (where the model is served: `derived_table_bytes`).
    The talker's char table (spec 4.2.2) is [vocab, longest token in characters] int64 once the tokenizer
    is set; without the tokenizer pass its longest token (tens of MiB at full size: the reserve covers it)."""
    from nemo_duplex.models.model import VoiceChat

    with torch.device("meta"):
        model = VoiceChat(cfg).cast_for_inference()
        model.perception.prepare_stream()  # the streaming encoder's per-layer tables (relative positions, stacked q/k/v)
        model.codec.prvq.stacked()  # the codec's stacked codebooks (ops/codebook_sum.py)
    built = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return (built + derived_table_bytes(cfg, device)
            + cfg.llm.vocab_size * (max_token_chars - model.talker.embed_subword.char_ids.shape[1]) * INT64)


def derived_table_bytes(cfg: ModelConfig, device: str | torch.device = "cuda") -> int:
    """Tables derived from the weights by VoiceChat.cast_for_inference (not built on meta), exact for a
    model it made ready on `device` (runtime.load):
    - the talker's (EarTTS.build_tables): a text row per token id and the padded code table in the
      talker's dtype, the codebooks and their norms in fp32;
    - the codec's pre-split decoder GEMM weights (RVQCodec.presplit_weights), where they are built:
      codec.presplit_used(cfg.codec.gemm, device), i.e. gemm "auto", "tf32x3w" or "fp16x3w" on CUDA,
      "tf32x3w" or "fp16x3w" on the CPU under TRITON_INTERPRET=1, nothing elsewhere (`codec_presplit_bytes`)."""
    from nemo_duplex.models.codec import presplit_used, resolve_gemm

    t = cfg.talker
    size = dtype_bytes(cfg.dtype.talker)
    text = cfg.llm.vocab_size * t.backbone.hidden_size * size
    code_table = t.num_quantizers * (t.codebook_size + 1) * t.latent_size * size
    books = t.num_quantizers * t.codebook_size * (t.latent_size + 1) * FLOAT32
    device = torch.device(device)
    codec = 0
    if presplit_used(cfg.codec.gemm, device):
        codec = codec_presplit_bytes(cfg, resolve_gemm(cfg.codec.gemm, device))
    return text + code_table + books + codec


def codec_presplit_bytes(cfg: ModelConfig, gemm: str) -> int:
    """The split of every weight of the codec decoder's GEMMs in decode_step (the GEMM kind's split_weight): per
    stage the upsampling ConvTranspose1d (C_in x C_out x rate) and num_blocks ConvNeXt blocks' pwconv1 and
    pwconv2 (4 C^2 each); then the final k=1 conv (C x (n_fft + 2)). "tf32x3w": w_hi and w_lo in fp32
    (700 MiB at full size); "fp16x3w": both in fp16 and an fp32 scale per output channel (350 MiB)."""
    c = cfg.codec
    weights, channels, width_in = 0, 0, c.latent_size
    for width, rate in zip([c.base_hidden_size * m for m in reversed(c.channel_mult)], reversed(c.rates)):
        weights += width_in * width * rate + c.num_blocks * 2 * 4 * width * width
        channels += width * rate + c.num_blocks * (4 * width + width)  # outputs: upsampling, pwconv1, pwconv2
        width_in = width
    weights += width_in * (c.n_fft + 2)
    channels += c.n_fft + 2
    if gemm == "tf32x3w":
        return 2 * FLOAT32 * weights
    assert gemm == "fp16x3w", gemm
    return 2 * 2 * weights + FLOAT32 * channels


class MemoryPlanError(ValueError):
    """The configured calls do not fit in the device's memory; the message says by how much and what fits."""


@dataclass
class MemoryPlan:
    max_calls: int
    max_call_s: float
    per_call: CallBytes
    weights: int
    reserve: int
    device_memory: int
    prefix_cache: int = 0
    kv_pool: int | None = None   # engine.kv_pool_gib in bytes: the KV pages, whatever the calls' limits

    @property
    def pools(self) -> int:   # max_calls + 1 rows: the last is the sink (docs/design.md)
        if self.kv_pool is None:
            return (self.max_calls + 1) * self.per_call.total
        return (self.max_calls + 1) * self.per_call.slot_without_kv + self.kv_pool

    @property
    def total(self) -> int:
        return self.weights + self.pools + self.prefix_cache + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.device_memory

    def summary(self) -> str:
        if self.max_calls == 0:
            return (f"memory plan: weights {self.weights / GiB:.2f} GiB, reserve {self.reserve / GiB:.2f} GiB: "
                    f"{self.total / GiB:.2f} GiB of {self.device_memory / GiB:.2f} GiB")
        if self.kv_pool is not None:
            return (f"memory plan: {self.max_calls} call slots + sink and {self.kv_pool / GiB:.2f} GiB of KV pages "
                    f"(engine.kv_pool_gib) = {self.pools / GiB:.2f} GiB of state, "
                    f"weights {self.weights / GiB:.2f} GiB, prefix cache {self.prefix_cache / GiB:.2f} GiB, "
                    f"reserve {self.reserve / GiB:.2f} GiB: "
                    f"{self.total / GiB:.2f} GiB of {self.device_memory / GiB:.2f} GiB")
        return (f"memory plan: {self.max_calls} calls x {self.per_call.total / 2**20:.1f} MiB "
                f"(max_call_s {self.max_call_s:g} s) + sink = {self.pools / GiB:.2f} GiB of state, "
                f"weights {self.weights / GiB:.2f} GiB, prefix cache {self.prefix_cache / GiB:.2f} GiB, "
                f"reserve {self.reserve / GiB:.2f} GiB: "
                f"{self.total / GiB:.2f} GiB of {self.device_memory / GiB:.2f} GiB")


def max_calls_that_fit(cfg: ModelConfig, max_call_s: float, device_memory: int, fixed: int,
                       max_prompt_tokens: int = 512) -> int:
    """fixed: the bytes that do not scale with calls (weights, prefix cache, reserve)."""
    per = bytes_per_call(cfg, max_call_s, max_prompt_tokens).total
    return max(0, (device_memory - fixed) // per - 1)


def max_call_s_that_fits(cfg: ModelConfig, max_calls: int, device_memory: int, fixed: int,
                         max_prompt_tokens: int = 512) -> float:
    """The longest calls (a multiple of the 80 ms frame) of which max_calls fit; 0 if none do."""
    room = (device_memory - fixed) // (max_calls + 1)
    fixed = bytes_per_call(cfg, 0.0, max_prompt_tokens).total
    per_frame = bytes_per_call(cfg, cfg.frame_length, max_prompt_tokens).total - fixed
    return max(0, (room - fixed) // per_frame) * cfg.frame_length


def plan(cfg: ModelConfig, max_calls: int, max_call_s: float, device_memory: int, *,
         max_prompt_tokens: int = 512, reserve: int = DEFAULT_RESERVE_BYTES, weights: int | None = None,
         prefix_cache_mib: int = 0, kv_pool_gib: float | None = None) -> MemoryPlan:
    """The memory of a server with these limits; raises MemoryPlanError naming engine.max_calls and
    engine.max_call_s (or engine.kv_pool_gib), the numbers, and what would fit, when it exceeds device_memory."""
    weights = weight_bytes(cfg) if weights is None else weights   # served on CUDA (derived_table_bytes)
    p = MemoryPlan(max_calls, max_call_s, bytes_per_call(cfg, max_call_s, max_prompt_tokens), weights, reserve,
                   device_memory, prefix_cache_mib * 2**20,
                   None if kv_pool_gib is None else int(float(kv_pool_gib) * GiB))
    if p.fits:
        return p
    fixed = weights + p.prefix_cache + reserve
    if p.kv_pool is not None:
        room = device_memory - fixed - (p.pools - p.kv_pool)
        raise MemoryPlanError(
            f"engine.kv_pool_gib = {kv_pool_gib:g} GiB of KV pages beside {max_calls} call slots (engine.max_calls) "
            f"do not fit in {device_memory / GiB:.2f} GiB: {p.summary()}. "
            + (f"At most engine.kv_pool_gib = {math.floor(room / GiB * 100) / 100:g} fits." if room > 0
               else "The slots alone do not fit: fewer engine.max_calls."))
    calls_fit = max_calls_that_fit(cfg, max_call_s, device_memory, fixed, max_prompt_tokens)
    seconds_fit = max_call_s_that_fits(cfg, max_calls, device_memory, fixed, max_prompt_tokens)
    big = sorted(asdict(p.per_call).items(), key=lambda kv: -kv[1])[:3]
    raise MemoryPlanError(
        f"engine.max_calls = {max_calls} calls of up to engine.max_call_s = {max_call_s:g} s do not fit in "
        f"{device_memory / GiB:.2f} GiB of device memory: {max_calls} calls + 1 sink row x "
        f"{p.per_call.total / 2**20:.1f} MiB per call = {p.pools / GiB:.2f} GiB of call state, plus "
        f"{weights / GiB:.2f} GiB of weights, {p.prefix_cache / GiB:.2f} GiB of prefix cache "
        f"(engine.prefix_cache_mib) and {reserve / GiB:.2f} GiB reserved (memory.reserve_gib) = "
        f"{p.total / GiB:.2f} GiB. Per call: "
        + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in big)
        + (f". The weights, prefix cache and reserve alone ({fixed / GiB:.2f} GiB) exceed it." if fixed >= device_memory
           else f". At engine.max_call_s = {max_call_s:g} s at most {calls_fit} calls fit; "
           + (f"{max_calls} calls fit at engine.max_call_s <= {seconds_fit:g} s."
              if seconds_fit > 0 else f"{max_calls} calls do not fit at any call length.")))


CPU_RESERVE_BYTES = 1 * GiB   # beyond the weights on the CPU: activations, the interpreter, the tokenizer


def available_bytes(device: str | torch.device) -> tuple[int, str]:
    """(bytes the device can still take, where that figure comes from): CUDA's free memory, or the
    kernel's MemAvailable on the CPU (what can be allocated without swapping)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical pages"


def device_budget(device: torch.device, device_gib: float | None = None,
                  reserve_gib: float | None = None) -> tuple[int, str, int]:
    """(bytes the plan may use, where that figure comes from, bytes reserved beyond the plan): memory.device_gib
    or what the device has free; memory.reserve_gib or 6 GiB on CUDA, 1 GiB on the CPU."""
    if device_gib is not None:
        budget, where = int(float(device_gib) * GiB), "memory.device_gib"
    else:
        budget, where = available_bytes(device)
    if reserve_gib is not None:
        return budget, where, int(float(reserve_gib) * GiB)
    return budget, where, DEFAULT_RESERVE_BYTES if device.type == "cuda" else CPU_RESERVE_BYTES


CPU_CALLS = 8   # engine.max_calls=null on the CPU


def calls_for_device(cfg: ModelConfig, device: str | torch.device, engine, *, device_gib: float | None = None,
                     reserve_gib: float | None = None) -> int:
    """engine.max_calls=null for the engine settings `engine` (an EngineConfig, or that node of a composed config):
    on a GPU, as many calls of engine.max_call_s as its memory holds beside the weights, the prefix cache and the
    reserve (with engine.kv_pool_gib: as many call slots beside that pool), at most the largest capture bucket (a
    larger batch steps as two); at least 1 (a server that cannot hold one is then refused by check_fits with the
    numbers). On the CPU CPU_CALLS: there the step's time, not the memory, is the limit."""
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_CALLS
    budget, _, reserve = device_budget(device, device_gib, reserve_gib)
    fixed = weight_bytes(cfg, device=device) + int(engine.prefix_cache_mib) * 2**20 + reserve
    max_call_s, max_prompt_tokens = float(engine.max_call_s), int(engine.max_prompt_tokens)
    if engine.kv_pool_gib is None:
        fit = max_calls_that_fit(cfg, max_call_s, budget, fixed, max_prompt_tokens)
    else:
        slot = bytes_per_call(cfg, max_call_s, max_prompt_tokens).slot_without_kv
        fit = max(0, (budget - fixed - int(float(engine.kv_pool_gib) * GiB)) // slot - 1)
    return max(1, min(int(fit), max(engine.capture_buckets, default=1)))


def check_fits(cfg: ModelConfig, device: str | torch.device, *, check: bool = True, device_gib: float | None = None,
               reserve_gib: float | None = None, calls: tuple[int, float] | None = None, max_prompt_tokens: int = 512,
               prefix_cache_mib: int = 0, kv_pool_gib: float | None = None) -> MemoryPlan | None:
    """Before anything is allocated: do the weights (at cfg's dtypes on `device`), and with `calls` =
    (max_calls, max_call_s) the call pools and prefix cache, fit the device? Raises MemoryPlanError with
    the numbers (needed, available) when they do not. The budget is `device_gib` (memory.device_gib) when
    set, else what the device has free; `reserve_gib` (memory.reserve_gib) defaults to 6 GiB on CUDA
    (`DEFAULT_RESERVE_BYTES`), 1 GiB on the CPU. `check` False (memory.check=false) skips it: None."""
    if not check:
        return None
    device = torch.device(device)
    budget, where, reserve = device_budget(device, device_gib, reserve_gib)
    weights = weight_bytes(cfg, device=device)
    dtypes = f"encoder {cfg.dtype.encoder}, llm {cfg.dtype.llm}, talker {cfg.dtype.talker}, codec {cfg.dtype.codec}"
    if calls is not None:
        try:
            return plan(cfg, calls[0], calls[1], budget, max_prompt_tokens=max_prompt_tokens, reserve=reserve,
                        weights=weights, prefix_cache_mib=prefix_cache_mib, kv_pool_gib=kv_pool_gib)
        except MemoryPlanError as e:
            raise MemoryPlanError(f"{cfg.name} on {device} ({dtypes}), budget {where}: {e}") from None
    p = MemoryPlan(0, 0.0, CallBytes(0, 0, 0, 0, 0, 0, 0, 0, 0), weights, reserve, budget)
    if p.weights + p.reserve > budget:
        raise MemoryPlanError(
            f"{cfg.name} does not fit on {device}: it needs {(weights + reserve) / GiB:.2f} GiB (weights "
            f"{weights / GiB:.2f} GiB at {dtypes}, plus {reserve / GiB:.2f} GiB reserved, memory.reserve_gib), and "
            f"{budget / GiB:.2f} GiB is available ({where}). Use a device with more memory, lower dtypes "
            f"(model/dtype=bf16), or memory.check=false to try anyway.")
    return p


# ---- the docs table ------------------------------------------------------------------------------------
# Usable memory as the driver reports it (nvidia-smi "memory.total").
DEVICES = {"80 GB (H100/A100 80GB)": 81559 * 2 ** 20, "141 GB (H200)": 143771 * 2 ** 20}


def inference_config(cfg: ModelConfig, compute: str = "bf16") -> ModelConfig:
    """The served dtypes: encoder, LLM and talker in `compute`; SSM state and codec stay fp32 (spec 1.6)."""
    return replace(cfg, dtype=replace(cfg.dtype, encoder=compute, llm=compute, talker=compute))


def markdown_table(cfg: ModelConfig, call_seconds=(30.0, 60.0, 160.0), max_prompt_tokens: int = 512,
                   reserve: int = DEFAULT_RESERVE_BYTES, prefix_cache_mib: int = 1280) -> str:
    weights = weight_bytes(cfg)
    prefix = prefix_cache_mib * 2**20
    rows = [bytes_per_call(cfg, s, max_prompt_tokens) for s in call_seconds]
    lines = ["| component (MiB per call) | " + " | ".join(f"max_call_s = {s:g}" for s in call_seconds) + " |",
             "|---|" + "---:|" * len(call_seconds)]
    for name in asdict(rows[0]):
        lines.append(f"| {name} | " + " | ".join(f"{getattr(r, name) / 2**20:.2f}" for r in rows) + " |")
    lines.append("| **total** | " + " | ".join(f"**{r.total / 2**20:.1f}**" for r in rows) + " |")
    lines += ["", f"Fixed: weights {weights / GiB:.2f} GiB, prefix cache {prefix / GiB:.2f} GiB "
              f"(engine.prefix_cache_mib: {prefix // prefix_entry_bytes(cfg, max_prompt_tokens)} prompts of "
              f"{max_prompt_tokens} tokens), reserve {reserve / GiB:.0f} GiB (activations, graph pools, CUDA "
              f"context). The pools hold max_calls + 1 rows (the sink).", "",
              "| device | " + " | ".join(f"max calls at {s:g} s" for s in call_seconds) + " |",
              "|---|" + "---:|" * len(call_seconds)]
    for dev, mem in DEVICES.items():
        fit = [max_calls_that_fit(cfg, s, mem, weights + prefix + reserve, max_prompt_tokens) for s in call_seconds]
        lines.append(f"| {dev}, {mem / GiB:.1f} GiB | " + " | ".join(str(n) for n in fit) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    # python -m nemo_duplex.serving.memory [capacity]: the table at conf/model/dtype/<name>.yaml's dtypes
    # (default bf16, the deployment)
    import sys

    from omegaconf import OmegaConf

    from nemo_duplex.models.config import CONF, DtypeConfig, preset

    name = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    path = CONF / "model" / "dtype" / f"{name}.yaml"
    if not path.is_file():
        sys.exit(f"no dtype preset {name!r} (conf/model/dtype/*.yaml)")
    dtype = DtypeConfig(**OmegaConf.to_container(OmegaConf.load(path)))
    print(markdown_table(replace(preset("nemotron_duplex"), dtype=dtype)))
