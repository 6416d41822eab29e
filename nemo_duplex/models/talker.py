"""EAR-TTS talker (MODEL_SPEC section 4): text token + previous codes -> 31 RVQ codes per frame.

Reads top to bottom: Gemma pieces (norm, rotary, attention, MLP), the Gemma3 backbone, the char-aware
subword encoder with its flag embeddings, gated fusion, the MoG head, then `EarTTS`, which holds them
under the official checkpoint names (spec 6.3, prefix `tts_model.tts_model.`) and implements the warm-up
(spec 4.3), one step (4.4) and the iterative RVQ decoding (4.5, 4.6).

Per-call state is a `TalkerCache` pool (one row per call plus a sink row, docs/design.md); every step
reads and writes only the rows named by `slots`. Random draws are inputs, never drawn here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nemo_duplex.models.config import CASConfig, GemmaConfig, MoGConfig, TalkerConfig
from nemo_duplex.models.stacking import StackedProjections, stack_all
from ops.activation import gelu_tanh_mul
from ops.argmin_residual import argmin_residual
from ops.codebook_sum import codebook_sum
from ops.decode_attention import decode_attention
from ops.mog_latent import mog_latent
from ops.rmsnorm import add_rms_norm, rms_norm, rms_norm_rope, rms_norm_rope_qk_store
from ops.top_p_sample import gumbel, top_p_gumbel_argmax

# Special ids of the LLM tokenizer (spec 3.8); `EarTTS.set_vocab` overrides them with the loaded tokenizer's.
DEFAULT_BOS_ID, DEFAULT_EOS_ID, DEFAULT_PAD_ID = 1, 2, 12


# ---------------------------------------------------------------------------------------------------------
# Gemma building blocks


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32 (spec 4.1, pitfall 9.6: the weight is an offset)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, offset=1.0)  # one kernel on CUDA (ops/rmsnorm.py)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + norm(x), the norm rounded to the compute dtype first (fused on CUDA)."""
        return rms_norm(x, self.weight, self.eps, offset=1.0, residual=residual)

    def add_to_then(self, residual: torch.Tensor, x: torch.Tensor, following: "GemmaRMSNorm"):
        """(s, following(s)) with s = add_to(residual, x): a block's post-norm and residual add and the next
        block's pre-norm, one kernel on CUDA (ops/rmsnorm.py add_rms_norm)."""
        return add_rms_norm(residual, x, following.weight, following.eps, offset=1.0, delta_weight=self.weight,
                            delta_eps=self.eps)


def rope_frequencies(head_dim: int, theta: float, device) -> torch.Tensor:
    """The rotary inverse frequencies [head_dim] (fp32), each half-dim frequency twice: rotate-half layout."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    return torch.cat([inv_freq, inv_freq])


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., head_dim] (fp32) for integer positions [...]: rotate-half layout over the full head dim."""
    angles = positions.float()[..., None] * rope_frequencies(head_dim, theta, positions.device)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos/sin [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rotated * sin


class GatedMLP(StackedProjections):
    """down(gelu_tanh(gate(x)) * up(x)), no biases (spec 4.1). gelu * up is one kernel on the GPU
    (ops/activation.py); once stacked, gate and up are one GEMM whose column halves it reads in place."""
    stacked = ("gate_proj", "up_proj")

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stack is not None:
            gate, up = F.linear(x, self.stack).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(gelu_tanh_mul(gate, up))


def attention_projections(module: nn.Module, cfg: GemmaConfig | CASConfig) -> None:
    """The q/k/v/o projections of a Gemma-style attention (no bias) on `module`, and its head counts."""
    module.num_heads, module.num_kv_heads, module.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                              cfg.head_dim)
    q, kv = module.num_heads * module.head_dim, module.num_kv_heads * module.head_dim
    module.q_proj = nn.Linear(cfg.hidden_size, q, bias=False)
    module.k_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
    module.v_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
    module.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)


class Gemma3Attention(StackedProjections):
    """Gemma3 self-attention: q/k RMSNorm over head_dim before RoPE, query scale query_pre_attn_scalar^-0.5
    (spec 4.1, pitfall 9.6), RoPE theta and sliding window by layer type."""
    stacked = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: GemmaConfig, layer: int):
        super().__init__()
        attention_projections(self, cfg)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        full = cfg.is_full_attention(layer)
        # spec 4.1: theta 1e6 on full layers, 1e4 (rope_local_base_freq) on sliding ones
        self.rope_theta = cfg.rope_theta if full else cfg.rope_local_base_freq
        self.window = None if full else cfg.sliding_window
        self.scale = cfg.query_pre_attn_scalar ** -0.5

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., H] -> the q, k, v projections [..., heads x D]: one GEMM when stacked, its output's
        column views (the norm + rotary kernels read them strided, no copies)."""
        if self.stack is not None:
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return F.linear(x, self.stack).split((q_size, kv_size, kv_size), dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def rotary(self, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None):
        """(cos, sin) [B, T, D] for positions [B, T]: `rope` if the caller computed them once for all layers."""
        return rope if rope is not None else rotary_cos_sin(positions, self.head_dim, self.rope_theta)

    def query(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q [B, T, heads x D] (the projection) -> [B, heads, T, D], normed and rotated (one kernel on CUDA,
        ops/rmsnorm.py, with the roundings of norm-then-rotate)."""
        b, t, _ = q.shape
        return rms_norm_rope(q.view(b, t, self.num_heads, self.head_dim), self.q_norm.weight,
                             self.q_norm.eps, cos, sin).transpose(1, 2)

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x [B, T, H], positions [B, T] -> q [B, heads, T, D], k, v [B, kv_heads, T, D] (normed, rotated).
        rope: this layer's (cos, sin) [B, T, D] if the caller computed them once for all layers."""
        b, t, _ = x.shape
        cos, sin = self.rotary(positions, rope)
        q, k, v = self.qkv(x)
        q = self.query(q, cos, sin)
        k = rms_norm_rope(k.view(b, t, self.num_kv_heads, self.head_dim), self.k_norm.weight,
                          self.k_norm.eps, cos, sin).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        """Full sequence, causal by position. -> (out [B, T, H], k, v) so a prefill can store k/v."""
        b, t, _ = x.shape
        q, k, v = self.project(x, positions)
        offset = positions[:, :, None] - positions[:, None, :]  # query position - key position
        visible = offset >= 0
        if self.window is not None:
            visible = visible & (offset < self.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), k, v

    def step(self, x: torch.Tensor, positions: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
             rows: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
             lengths: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row: x [N, H], positions [N]; writes k/v at (rows, positions) of the pools
        [R, kv_heads, L, D] in place, then attends over the row's cache. -> [N, H]. `lengths` =
        positions + 1 if the caller has it (the backbone computes it once for all layers)."""
        n = x.shape[0]
        cos, sin = self.rotary(positions[:, None], rope)
        q, k, v = self.qkv(x)
        heads = (n, 1, self.num_kv_heads, self.head_dim)
        # q normed and rotated, and k likewise with v straight into the pools: one kernel on the GPU
        # (ops/rmsnorm.py; q and k share the config's eps and, here, the head count)
        q = rms_norm_rope_qk_store(q.view(n, 1, self.num_heads, self.head_dim), self.q_norm.weight, k.view(heads),
                                   self.k_norm.weight, self.k_norm.eps, cos, sin, v.view(heads), pool_k, pool_v,
                                   rows, positions)
        lengths = positions + 1 if lengths is None else lengths
        out = decode_attention(q[:, 0], pool_k, pool_v, rows, lengths, self.scale, self.window)
        return self.o_proj(out.reshape(x.shape[0], -1))


class Gemma3Layer(nn.Module):
    """x += post_attn_norm(attn(input_norm(x))); x += post_ff_norm(mlp(pre_ff_norm(x))) (spec 4.1)."""

    def __init__(self, cfg: GemmaConfig, layer: int):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Gemma3Attention(cfg, layer)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm.add_to(x, self.mlp(self.pre_feedforward_layernorm(x)))

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        attn, k, v = self.self_attn(self.input_layernorm(x), positions)
        x = x + self.post_attention_layernorm(attn)
        return self.feed_forward(x), k, v

    def step(self, x, h, following, positions, pool_k, pool_v, rows, rope=None, lengths=None):
        """x [N, H] the residual stream, h = input_layernorm(x) -> (the new x, following(x)): each residual
        add runs with the next norm (`add_to_then`); `following` is the next layer's input_layernorm or
        the backbone's final norm."""
        attn = self.self_attn.step(h, positions, pool_k, pool_v, rows, rope, lengths)
        x, h = self.post_attention_layernorm.add_to_then(x, attn, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm.add_to_then(x, self.mlp(h), following)


@dataclass
class TalkerCache:
    """Backbone KV pools: k, v [n_layers, 2, S, kv_heads, max_len, head_dim]; dim 1 is the CFG stream
    (0 = conditional, 1 = unconditional), dim 2 the slot (the last slot is the sink)."""
    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.k.shape[2]

    def layer_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [2 * S, kv_heads, max_len, D] of one layer: row = stream * S + slot."""
        return self.k[layer].flatten(0, 1), self.v[layer].flatten(0, 1)


class Gemma3Backbone(nn.Module):
    """HF gemma3_text without its embedding table: inputs_embeds in, no sqrt(hidden) scaling (spec 4.1)."""

    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.layers = nn.ModuleList(Gemma3Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # the layers' rotary thetas (full and sliding, spec 4.1) and their frequencies [thetas, head_dim], fp32,
        # not in the state_dict: a step takes every layer's cos / sin from one product (built again after a
        # cast or move, `_apply`, from the same expression rotary_cos_sin uses)
        self.rope_thetas = list(dict.fromkeys(layer.self_attn.rope_theta for layer in self.layers))
        self.register_buffer("rope_freqs", torch.empty(0), persistent=False)
        self._build_rope_freqs()

    def _build_rope_freqs(self) -> None:
        head_dim, device = self.layers[0].self_attn.head_dim, self.rope_freqs.device
        self.rope_freqs = torch.stack([rope_frequencies(head_dim, theta, device) for theta in self.rope_thetas])

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self._build_rope_freqs()   # fp32 whatever the cast (a bf16 copy would rotate by rounded angles)
        return out

    def prefill(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, H], positions [B, T] -> (h [B, T, H], per-layer (k, v) [B, kv_heads, T, D])."""
        kv = []
        for layer in self.layers:
            x, k, v = layer(x, positions)
            kv.append((k, v))
        return self.norm(x), kv

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.prefill(x, positions)[0]

    def step(self, x: torch.Tensor, positions: torch.Tensor, cache: TalkerCache, rows: torch.Tensor) -> torch.Tensor:
        """x [N, H] one token per row at positions [N]; rows [N] index the stream-major pool (stream * S + slot)."""
        # cos / sin once per step for both thetas (full and sliding layers), not once per layer or theta: the
        # values rotary_cos_sin gives (positions as fp32 times the same frequencies), in the compute dtype
        angles = positions[:, None, None] * self.rope_freqs   # [N, thetas, D]: int64 x fp32 is fp32(pos) x f
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        ropes = {theta: (cos[:, i:i + 1], sin[:, i:i + 1]) for i, theta in enumerate(self.rope_thetas)}
        lengths = positions + 1  # keys each row attends over, the new one included (once, not per layer)
        h = self.layers[0].input_layernorm(x)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            pool_k, pool_v = cache.layer_pools(i)
            following = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, h = layer.step(x, h, following, positions, pool_k, pool_v, rows, ropes[attn.rope_theta], lengths)
        return h


# ---------------------------------------------------------------------------------------------------------
# Text conditioning: char-aware subword encoder (spec 4.2.2)


class CharEncoderAttention(nn.Module):
    """T5Gemma encoder self-attention: bidirectional, no q/k norm, logit soft-capping tanh(s/c)*c."""

    def __init__(self, cfg: CASConfig):
        super().__init__()
        attention_projections(self, cfg)
        self.rope_theta = cfg.rope_theta
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.softcap = cfg.attn_logit_softcapping

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """x [N, C, H] chars of N tokens, valid [N, C] key-padding mask."""
        n, c, _ = x.shape
        q = self.q_proj(x).view(n, c, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(n, c, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(n, c, self.num_kv_heads, self.head_dim).transpose(1, 2)
        positions = torch.arange(c, device=x.device).expand(n, c)
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.rope_theta)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = (q @ k.transpose(-1, -2)).float() * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        # finite fill (not -inf): a token with no known chars has every key masked; its rows stay finite
        # and are dropped by the pooling
        scores = scores.masked_fill(~valid[:, None, None, :], torch.finfo(torch.float32).min)
        out = scores.softmax(-1).to(v.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(n, c, -1))


class CharEncoderLayer(nn.Module):
    def __init__(self, cfg: CASConfig):
        super().__init__()
        self.pre_self_attn_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = CharEncoderAttention(cfg)
        self.post_self_attn_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = self.post_self_attn_layernorm.add_to(x, self.self_attn(self.pre_self_attn_layernorm(x), valid))
        return self.post_feedforward_layernorm.add_to(x, self.mlp(self.pre_feedforward_layernorm(x)))


class CharEncoder(nn.Module):
    """T5Gemma encoder stack (no embedding table): inputs scaled by sqrt(hidden), layers, final norm."""

    def __init__(self, cfg: CASConfig):
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.layers = nn.ModuleList(CharEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = x * torch.tensor(self.hidden_size ** 0.5, dtype=x.dtype)
        for layer in self.layers:
            x = layer(x, valid)
        return self.norm(x)


class SubwordFlagEmbedding(nn.Module):
    """Adds cont_emb[is_continuation[id]]; ids past the table map to the pad entry (spec 4.2.2)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.cont_emb = nn.Embedding(2, hidden_size)
        self.register_buffer("is_continuation", torch.zeros(vocab_size + 1, dtype=torch.long))
        self.register_buffer("pad_tensor", torch.tensor(vocab_size, dtype=torch.long))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ids = torch.where(ids >= self.is_continuation.shape[0] - 1, self.pad_tensor, ids)
        return x + self.cont_emb(self.is_continuation[ids])


class BOSEOSEmbedding(nn.Module):
    """Adds special_emb[special_flags[id]] (0 regular, 1 BOS, 2 EOS); the table's last entry is the pad slot."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.special_emb = nn.Embedding(3, hidden_size)
        self.register_buffer("special_flags", torch.zeros(vocab_size, dtype=torch.long))
        self.register_buffer("pad_tensor", torch.tensor(vocab_size - 1, dtype=torch.long))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ids = torch.where(ids >= self.special_flags.shape[0] - 1, self.pad_tensor, ids)
        return x + self.special_emb(self.special_flags[ids])


class CharAwareSubwordEncoder(nn.Module):
    """Token id -> embedding of its characters (1-layer T5Gemma encoder, mean-pooled, projected), plus the
    continuation and BOS/EOS flag embeddings (spec 4.2.2). The char table (`char_ids`, `char_len`) comes
    from the tokenizer through `set_vocab`; it is not part of the checkpoint."""

    def __init__(self, cfg: CASConfig, vocab_size: int, out_size: int):
        super().__init__()
        self.num_chars = cfg.num_chars
        self.embed_tokens = nn.Embedding(cfg.num_chars + 1, cfg.hidden_size)  # last row: pad char
        self.backbone = nn.ModuleDict({"encoder": CharEncoder(cfg)})  # official path: T5GemmaEncoderModel.encoder
        self.proj_embedding = nn.Linear(cfg.hidden_size, out_size, bias=False)
        self.subword_flag_emb = SubwordFlagEmbedding(vocab_size, out_size)
        self.bos_eos_emb = BOSEOSEmbedding(vocab_size, out_size)
        self.register_buffer("char_ids", torch.full((vocab_size, 1), cfg.num_chars, dtype=torch.long), persistent=False)
        self.register_buffer("char_len", torch.zeros(vocab_size, dtype=torch.long), persistent=False)

    def encode_chars(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] -> mean-pooled, projected char encoding [N, out]; zero for a token with no known chars."""
        chars, lengths = self.char_ids[ids], self.char_len[ids]
        valid = torch.arange(chars.shape[1], device=ids.device)[None, :] < lengths[:, None]
        h = self.backbone["encoder"](self.embed_tokens(chars), valid)
        pooled = (h * valid[..., None].to(h.dtype)).sum(1) / lengths.clamp(min=1)[:, None].to(h.dtype)
        return self.proj_embedding(pooled)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids [N] -> [N, out]. `mask` false zeroes only the char encoding: the flags are added at every
        position (spec 12.5)."""
        emb = self.encode_chars(ids)
        if mask is not None:
            emb = emb * mask[:, None].to(emb.dtype)
        return self.bos_eos_emb(self.subword_flag_emb(emb, ids), ids)


# ---------------------------------------------------------------------------------------------------------
# Gated fusion of code and text embeddings (spec 4.2.3)


class GatedProjectedSumRMSNorm(nn.Module):
    """final_norm(sigmoid(s) * (g * audio_proj(audio / Q) + (1 - g) * text_proj(text))), g = sigmoid(gate)."""

    def __init__(self, hidden_size: int, num_quantizers: int, eps: float = 1e-6):
        super().__init__()
        self.num_quantizers = num_quantizers
        self.audio_proj = nn.Linear(hidden_size, hidden_size)
        self.text_proj = nn.Linear(hidden_size, hidden_size)
        self.gate = nn.Parameter(torch.zeros(hidden_size))
        self.residual_scale = nn.Parameter(torch.tensor(0.0))
        self.final_norm = GemmaRMSNorm(hidden_size, eps)

    def forward(self, audio: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        a = self.audio_proj(audio / self.num_quantizers).float()
        b = self.text_proj(text).float()
        g = torch.sigmoid(self.gate.float())  # gate and scale in fp32 (spec 4.2.3)
        h = torch.sigmoid(self.residual_scale.float()) * (g * a + (1 - g) * b)
        return self.final_norm(h).to(audio.dtype)


# ---------------------------------------------------------------------------------------------------------
# Mixture-of-Gaussians head (spec 4.6)


class MoGLayer(nn.Module):
    """x + post_norm(GatedMLP(pre_norm(x)))."""

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float):
        super().__init__()
        self.pre_norm = GemmaRMSNorm(hidden_size, eps)
        self.mlp = GatedMLP(hidden_size, intermediate_size)
        self.post_norm = GemmaRMSNorm(hidden_size, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm.add_to(x, self.mlp(self.pre_norm(x)))


class MoGHead(StackedProjections):
    """Trunk (`mlp_stack`: layers then a final norm), then per-component low-rank means. Once stacked,
    proj_logits and proj_else are one GEMM (`heads`)."""
    stacked = ("proj_logits", "proj_else")

    def __init__(self, cfg: MoGConfig, hidden_size: int, latent_size: int):
        super().__init__()
        self.num_predictions, self.low_rank, self.min_log_std = cfg.num_predictions, cfg.low_rank, cfg.min_log_std
        self.mlp_stack = nn.Sequential(*[MoGLayer(hidden_size, cfg.intermediate_size, cfg.eps) for _ in range(cfg.num_layers)],
                                       GemmaRMSNorm(hidden_size, cfg.eps))
        self.proj_logits = nn.Linear(hidden_size, cfg.num_predictions, bias=False)
        self.proj_mus = nn.Linear(hidden_size, cfg.num_predictions * cfg.low_rank, bias=False)
        self.proj_logs = nn.Linear(hidden_size, 1, bias=False)
        self.proj_else = nn.Linear(hidden_size, latent_size, bias=False)
        self.low_mat = nn.Parameter(torch.zeros(cfg.num_predictions, latent_size, cfg.low_rank))

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The trunk, `mlp_stack(h + e)`, as joints: each layer's post-norm and residual add with the next
        norm (the next layer's pre-norm, or the final norm) in one kernel on the GPU (ops/rmsnorm.py
        add_rms_norm), and the input sum with the first pre-norm: 3 fewer launches per layer, the same
        roundings as the Sequential's modules one after another (the references compose them)."""
        layers, final = list(self.mlp_stack)[:-1], self.mlp_stack[-1]
        first = layers[0].pre_norm
        x, y = add_rms_norm(h, e, first.weight, first.eps, offset=1.0)
        for layer, following in zip(layers, [layer.pre_norm for layer in layers[1:]] + [final]):
            x, y = layer.post_norm.add_to_then(x, layer.mlp(y), following)
        return y

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, H] -> (proj_logits(x) [B, P], proj_else(x) [B, L]): views of one GEMM's output once stacked."""
        if self.stack is None:
            return self.proj_logits(x), self.proj_else(x)
        out = F.linear(x, self.stack)
        return out[:, :self.num_predictions], out[:, self.num_predictions:]


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """HF TopKLogitsWarper: drop entries below the k-th largest."""
    kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def residual_quantise(z: torch.Tensor, codebooks: torch.Tensor, norms: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy RVQ of z [B, latent] through codebooks [k, codebook, latent] -> codes [B, k]:
    idx = argmin ||e_j||^2 - 2 r.e_j, then r -= e_idx (spec 4.6). norms [k, codebook]: the books'
    squared norms, if the caller has them."""
    r = z.float()
    books = codebooks.float()
    norms = books.pow(2).sum(-1) if norms is None else norms
    codes = []
    for book, norm in zip(books, norms):
        # one GEMM for the distances. With the norms as a 1-D bias cuBLAS adds them in its epilogue; a
        # [1, codebook] view was first copied into every output row (H200, 31 books: 435 -> 382 us at 32
        # calls, 706 -> 637 at 128, bit for bit the same; docs/performance.md)
        distances = torch.addmm(norm, r, book.T, alpha=-2)
        idx, r = argmin_residual(distances, r, book)  # argmin, gather, subtract: one kernel on the GPU
        codes.append(idx)
    return torch.stack(codes, dim=-1)


# ---------------------------------------------------------------------------------------------------------
# The talker


class EarTTS(nn.Module):
    """`tts_model.tts_model.*` of the checkpoint (spec 4, keys 6.3)."""
    DERIVED_TABLES = ("text_table", "rvq_table", "rvq_books", "rvq_norms")   # build_tables

    def __init__(self, cfg: TalkerConfig, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        hidden = cfg.backbone.hidden_size
        self.backbone = Gemma3Backbone(cfg.backbone)
        self.embed_code = nn.Linear(cfg.latent_size, hidden, bias=False)
        self.bos_emb = nn.Parameter(torch.zeros(hidden))
        self.null_emb = nn.Parameter(torch.zeros(hidden))
        # frozen projection used only to build a latent from prompt audio; the stored speaker latent replaces it
        self.audio_prompt_projection_W = nn.Parameter(torch.zeros(hidden, hidden))
        self.rvq_embs = nn.Parameter(torch.zeros(cfg.num_quantizers, cfg.codebook_size, cfg.latent_size))
        self.embed_subword = CharAwareSubwordEncoder(cfg.cas, vocab_size, hidden)
        self.gated_fusion_audio_text = GatedProjectedSumRMSNorm(hidden, cfg.num_quantizers, cfg.backbone.rms_norm_eps)
        self.mog_head = MoGHead(cfg.mog, hidden, cfg.latent_size)
        self.bos_id, self.eos_id, self.pad_id = DEFAULT_BOS_ID, DEFAULT_EOS_ID, DEFAULT_PAD_ID
        self.vocab_is_set = False
        # codebooks filled by each effective MoG pass (spec 4.6): [1, 1, 3, 4, 22] at 31
        self.pass_sizes = [k for k in cfg.unmask_schedule() if k > 0]
        # Tables derived from the weights (build_tables; not in the state_dict, empty until built):
        #   text_table  text_condition of every token id [vocab, H]
        #   rvq_table   code_table() [Q * (codebook + 1), latent]
        #   rvq_books   the codebooks in fp32 [Q, codebook, latent], rvq_norms their squared norms [Q, codebook]
        for name in self.DERIVED_TABLES:
            self.register_buffer(name, torch.empty(0), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.weights_loaded())

    @property
    def num_passes(self) -> int:
        return len(self.pass_sizes)

    def stack_projections(self) -> None:
        """Every Gemma attention's q/k/v and every gated MLP's gate/up (backbone, MoG trunk, char encoder)
        as one GEMM each (`stack_linears`): 100 fewer GEMMs per frame step at full size (census), and the MoG
        head's logits / else projections (5 more). Call it once the weights are on their device in their dtype
        (VoiceChat.cast_for_inference does)."""
        stack_all(self)

    # --- tokenizer tables ------------------------------------------------------------------------------

    def set_vocab(self, id_to_token: list[str], bos_id: int, eos_id: int, pad_id: int = DEFAULT_PAD_ID) -> None:
        """Flag buffers and the char table from the tokenizer's token strings (spec 4.2.2)."""
        if len(id_to_token) != self.vocab_size:
            raise ValueError(f"tokenizer has {len(id_to_token)} tokens, the talker was built for {self.vocab_size}")
        device = self.embed_subword.char_ids.device
        char_index: dict[str, int] = {}
        for token in id_to_token:  # single-character tokens in id order, densely re-indexed
            if len(token) == 1 and token not in char_index:
                char_index[token] = len(char_index)
        if len(char_index) != self.cfg.cas.num_chars:
            raise ValueError(f"tokenizer has {len(char_index)} single-character tokens, "
                             f"cas.num_chars is {self.cfg.cas.num_chars}")
        token_chars = [[char_index[ch] for ch in token if ch in char_index] for token in id_to_token]
        max_chars = max(1, max(len(chars) for chars in token_chars))
        pad_char = self.cfg.cas.num_chars
        char_ids = torch.tensor([chars + [pad_char] * (max_chars - len(chars)) for chars in token_chars], dtype=torch.long)
        char_len = torch.tensor([len(chars) for chars in token_chars], dtype=torch.long)

        continuation = [0 if token.startswith(("Ġ", "▁", "<")) else 1 for token in id_to_token] + [0]  # + pad
        special = [1 if i == bos_id else 2 if i == eos_id else 0 for i in range(self.vocab_size)]
        special[-1] = 0  # last entry is the pad slot of the table
        sub = self.embed_subword
        sub.subword_flag_emb.is_continuation.copy_(torch.tensor(continuation))
        sub.subword_flag_emb.pad_tensor.fill_(self.vocab_size)
        sub.bos_eos_emb.special_flags.copy_(torch.tensor(special))
        sub.bos_eos_emb.pad_tensor.fill_(self.vocab_size - 1)
        sub.char_ids = char_ids.to(device)
        sub.char_len = char_len.to(device)
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.vocab_is_set = True
        self.weights_loaded()   # the text table was built from the old char table

    # --- embeddings ------------------------------------------------------------------------------------

    def code_table(self) -> torch.Tensor:
        """The codebooks with a zero row appended to each, flattened: [Q * (codebook + 1), latent]."""
        q, cb, latent = self.rvq_embs.shape
        return F.pad(self.rvq_embs, (0, 0, 0, 1)).reshape(q * (cb + 1), latent)

    def depthsum(self, codes: torch.Tensor, table: torch.Tensor | None = None, repeat: int = 1) -> torch.Tensor:
        """codes [..., Q] -> sum_i rvq_embs[i][codes_i] [..., latent], summed in codebook order in fp32 (one
        kernel on the GPU, ops/codebook_sum.py); code == codebook_size (speech pad / masked) adds the appended
        zero row (spec 4.2.1). `table`: code_table(), if the caller has it. `repeat` (codes [B, Q]): the B
        rows `repeat` times over, [repeat x B, latent] (both CFG streams)."""
        table = self.rvq_tables()[0] if table is None else table
        q, latent = self.cfg.num_quantizers, table.shape[-1]
        return codebook_sum(codes, table.view(q, -1, latent), repeat)

    def embed_codes(self, codes: torch.Tensor, table: torch.Tensor | None = None, repeat: int = 1) -> torch.Tensor:
        return self.embed_code(self.depthsum(codes, table, repeat))

    def text_condition(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B] -> [B, H]: char-aware embedding + flags (mask true); a row of `text_table` once built."""
        if self.text_table.numel():
            return F.embedding(ids, self.text_table)
        return self.embed_subword(ids)

    def rvq_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(code_table(), the codebooks in fp32, their squared norms): built once (build_tables), else
        computed, the same ops either way."""
        if self.rvq_books.numel():
            return self.rvq_table, self.rvq_books, self.rvq_norms
        books = self.rvq_embs.float()
        return self.code_table(), books, books.pow(2).sum(-1)

    @torch.no_grad()
    def build_tables(self, chunk: int = 1024) -> None:
        """The tables a frame step would otherwise derive from the weights every time:
        - text_table: text_condition of every token id. It depends on the id alone (the char encoder sees
          only the token's own characters; the flags are per id), so a step looks up one row per call
          instead of running the char encoder: ~80 fewer launches per step (scripts/dev/census_step.py), for
          vocab x H values (302 MiB in bf16 at full size). Built in chunks of `chunk` ids (the char
          encoder's activations grow with the longest token's characters squared: ~1 GiB of attention
          scores per 1024 ids at 128 characters), so its values equal the char encoder's within the
          rounding of other batch shapes.
        - rvq_table, rvq_books, rvq_norms: the padded code table, the fp32 codebooks and their norms (4
          launches and ~0.3 GB of memory traffic per step at full size; 97 MiB kept), bit for bit what
          the step computed.
        All counted by memory.weight_bytes. Rebuilt after a cast or move (`_apply`); dropped when the
        weights or the tokenizer tables change (`weights_loaded`, `set_vocab`), after which the step
        derives them again until the next build (VoiceChat.cast_for_inference builds them)."""
        self.weights_loaded()
        ids = torch.arange(self.vocab_size, device=self.bos_emb.device)
        text_table = torch.cat([self.embed_subword(ids[i:i + chunk]) for i in range(0, self.vocab_size, chunk)])
        rvq_table, rvq_books, rvq_norms = self.rvq_tables()
        # detach: in fp32, .float() is the Parameter itself, which setattr would register as a parameter
        self.text_table, self.rvq_table, self.rvq_books, self.rvq_norms = (
            text_table, rvq_table, rvq_books.detach(), rvq_norms)

    def weights_loaded(self) -> None:
        """The weights were overwritten in place (checkpoint.load_state, load_state_dict): the derived
        tables are stale."""
        for name in self.DERIVED_TABLES:
            setattr(self, name, torch.empty(0, device=self.bos_emb.device))

    def _apply(self, fn, *args, **kwargs):
        built = self.text_table.numel() > 0
        out = super()._apply(fn, *args, **kwargs)
        if built:   # cast tables would be the old dtype's values rounded, not the new dtype's computation
            self.build_tables()
        return out

    def fuse(self, audio: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return self.gated_fusion_audio_text(audio, text)

    # --- warm-up (spec 4.3 with the 12.5 correction) ---------------------------------------------------

    def warmup_inputs(self, speaker_latent: torch.Tensor, silence_codes: torch.Tensor):
        """-> (x_cond [P, H], x_uncond [P, H]), P = the latent's rows (37).
        Code track: rows 0..P-2 = the stored latent, row P-1 = embed_code(depthsum(silence)) + bos_emb.
        Text track: PAD at 0..P-2, EOS at P-1; char encoding only at P-2 and P-1, flags everywhere.
        The unconditional stream replaces the whole text track by null_emb."""
        latent = speaker_latent.reshape(-1, speaker_latent.shape[-1])
        p = latent.shape[0]
        bos_row = self.embed_codes(silence_codes) + self.bos_emb
        audio = torch.cat([latent[: p - 1].to(bos_row.dtype), bos_row[None]], dim=0)
        ids = torch.full((p,), self.pad_id, dtype=torch.long, device=audio.device)
        ids[p - 1] = self.eos_id
        mask = torch.zeros(p, dtype=torch.bool, device=audio.device)
        mask[p - 2:] = True
        cond = self.embed_subword(ids, mask)
        x = self.fuse(torch.cat([audio, audio]), torch.cat([cond, self.null_emb.expand(p, -1)]))
        return x[:p], x[p:]

    def prefill_warmup(self, cache: TalkerCache, slots: torch.Tensor, speaker_latent: torch.Tensor,
                       silence_codes: torch.Tensor) -> None:
        """Write positions 0..P-1 of both streams of `slots` (the same speaker for all of them)."""
        x_cond, x_uncond = self.warmup_inputs(speaker_latent, silence_codes)
        p = x_cond.shape[0]
        positions = torch.arange(p, device=x_cond.device).expand(2, p)
        _, kv = self.backbone.prefill(torch.stack([x_cond, x_uncond]), positions)
        for i, (k, v) in enumerate(kv):  # k, v [2 streams, kv_heads, P, D]
            cache.k[i, :, slots, :, :p] = k[:, None].to(cache.k.dtype)
            cache.v[i, :, slots, :, :p] = v[:, None].to(cache.v.dtype)

    def allocate_cache(self, num_slots: int, max_len: int, device, dtype) -> TalkerCache:
        """num_slots counts the sink row."""
        b = self.cfg.backbone
        shape = (b.num_hidden_layers, 2, num_slots, b.num_key_value_heads, max_len, b.head_dim)
        return TalkerCache(k=torch.zeros(shape, device=device, dtype=dtype),
                           v=torch.zeros(shape, device=device, dtype=dtype))

    # --- one frame (spec 4.4) --------------------------------------------------------------------------

    def step(self, text_ids: torch.Tensor, prev_codes: torch.Tensor, cache: TalkerCache, slots: torch.Tensor,
             positions: torch.Tensor, uniform: torch.Tensor, normal: torch.Tensor,
             silence_codes: torch.Tensor) -> torch.Tensor:
        """text_ids [B] (this frame's LLM token), prev_codes [B, Q], positions [B] -> codes [B, Q]."""
        b = text_ids.shape[0]
        if self.cfg.force_silence_on_eos:  # only true EOS, never PAD (spec 4.4.1)
            prev_codes = torch.where((text_ids == self.eos_id)[:, None], silence_codes[None, :], prev_codes)
        audio = self.embed_codes(prev_codes, repeat=2)  # no shift at step time; both streams' rows
        cond = self.text_condition(text_ids)
        x = self.fuse(audio, torch.cat([cond, self.null_emb.expand(b, -1)]))
        rows = torch.cat([slots, slots + cache.num_slots])  # stream-major pool rows
        h = self.backbone.step(x, torch.cat([positions, positions]), cache, rows)
        return self.generate_step(h, uniform, normal)

    # --- MoG sampling and iterative RVQ decoding (spec 4.5, 4.6, 12.8) ---------------------------------

    def guided_latent(self, h: torch.Tensor, e: torch.Tensor, noise: torch.Tensor, normal: torch.Tensor) -> torch.Tensor:
        """One MoG pass: backbone output h [2B, H] (the conditional stream's rows, then the unconditional
        one's) plus the code embedding e [2B, H] into the trunk -> z [B, latent] fp32. CFG acts on the trunk
        output (spec 4.5, pitfall 9.7), x_c + g (x_c - x_u) as one lerp (one rounding); component by
        Gumbel-max (noise [B, num_predictions] = gumbel(uniform)) over the top-p (or top-k) filtered logits;
        top-p and the latent draw each one kernel on the GPU (ops/top_p_sample.py, ops/mog_latent.py)."""
        head = self.mog_head
        x = head(h, e)
        b = x.shape[0] // 2
        x = torch.lerp(x[b:], x[:b], 1.0 + self.cfg.guidance_scale)
        logits, mu_else = head.heads(x)
        if self.cfg.top_k > 0:
            component = (top_k_filter(logits.float(), self.cfg.top_k).log_softmax(-1) + noise).argmax(-1)
        else:
            component = top_p_gumbel_argmax(logits, noise, self.cfg.top_p)
        return mog_latent(x, component, head.proj_mus.weight, head.low_mat, head.proj_logs.weight, mu_else,
                          normal, head.min_log_std, self.cfg.noise_scale)

    def generate_step(self, h: torch.Tensor, uniform: torch.Tensor, normal: torch.Tensor) -> torch.Tensor:
        """h [2B, H] (conditional stream's rows, then the unconditional one's); uniform [B, passes,
        num_predictions], normal [B, passes, latent] -> codes [B, Q]. Each pass sees all codes filled so far
        (the rest masked) and quantises a fresh z into its codebooks."""
        codes = torch.full((h.shape[0] // 2, self.cfg.num_quantizers), self.cfg.codebook_size,
                           dtype=torch.long, device=h.device)
        # once per step at most, not once per pass or per codebook: the padded table, fp32 books, their
        # norms (built once: build_tables), every pass's Gumbel draws and normal draws in the latent's dtype
        table, books, norms = self.rvq_tables()
        noise = gumbel(uniform.float())
        normal = normal.to(self.mog_head.proj_else.weight.dtype)
        start = 0
        for p, size in enumerate(self.pass_sizes):
            e = self.embed_codes(codes, table, repeat=2)
            z = self.guided_latent(h, e, noise[:, p], normal[:, p])
            # restart from z every pass: the MoG predicts the sum of the remaining codebooks (pitfall 9.8)
            codes[:, start:start + size] = residual_quantise(z, books[start:start + size], norms[start:start + size])
            start += size
        return codes

    # --- random weights --------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Seeded random values that keep activations O(1). Drawn on CPU, then copied to each tensor's device.
        Int flag buffers are drawn only when no tokenizer has set them."""
        hidden = self.cfg.backbone.hidden_size
        final_norm = f"mog_head.mlp_stack.{self.cfg.mog.num_layers}.weight"

        def randn(shape, std):
            return torch.randn(shape, generator=generator, device=generator.device) * std

        for name, param in self.named_parameters():
            shape = tuple(param.shape)
            if name.endswith(("norm.weight", "layernorm.weight")) or name == final_norm:
                value = randn(shape, 0.1)  # Gemma norms scale by (1 + w)
            elif name == "rvq_embs":
                value = randn(shape, self.cfg.latent_size ** -0.5)  # continuous draws: distinct codewords
            elif name == "mog_head.low_mat":
                value = randn(shape, self.cfg.mog.low_rank ** -0.5)
            elif name == "embed_subword.embed_tokens.weight":
                value = randn(shape, hidden ** -0.5)  # the char encoder scales its input by sqrt(hidden)
            elif name.endswith(("gate", "residual_scale")):
                value = randn(shape, 0.5)
            elif name.endswith("bias"):
                value = randn(shape, 0.02)
            elif name.endswith(("bos_emb", "null_emb", "cont_emb.weight", "special_emb.weight")):
                value = randn(shape, 1.0)
            else:  # [out, in] projections
                value = randn(shape, shape[-1] ** -0.5)
            param.copy_(value.to(param.device, param.dtype))

        if not self.vocab_is_set:
            flags = self.embed_subword.subword_flag_emb
            cont = torch.randint(0, 2, tuple(flags.is_continuation.shape), generator=generator,
                                 device=generator.device)
            cont[-1] = 0
            flags.is_continuation.copy_(cont.to(flags.is_continuation.device))
            flags.pad_tensor.fill_(self.vocab_size)
            special = self.embed_subword.bos_eos_emb
            table = torch.zeros(tuple(special.special_flags.shape), dtype=torch.long)
            table[self.bos_id], table[self.eos_id] = 1, 2
            special.special_flags.copy_(table.to(special.special_flags.device))
            special.pad_tensor.fill_(self.vocab_size - 1)
