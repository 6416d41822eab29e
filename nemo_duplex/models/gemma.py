"""The Gemma3 backbone of the EAR-TTS talker (MODEL_SPEC section 4.1): HF gemma3_text without its embedding
table, plus the pieces the talker's char encoder and MoG head share (the offset RMSNorm, rotary embedding,
gated MLP, attention projections).

Reads top to bottom: the norm, rotary embedding, gated MLP, attention, one layer, the backbone's KV pools
(`TalkerCache`), the backbone. A full sequence runs through `forward` / `prefill`; one token per call row
through `step`, which reads and writes only the pool rows it is given.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nemo_duplex.models.config import CASConfig, GemmaConfig
from nemo_duplex.models.stacking import StackedProjections
from ops.activation import gelu_tanh_mul
from ops.decode_attention import decode_attention
from ops.rmsnorm import add_rms_norm, rms_norm, rms_norm_rope, rms_norm_rope_qk_store


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

    def add_to_then(self, residual: torch.Tensor, x: torch.Tensor, following: GemmaRMSNorm):
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
            gate, up = self.stacked_product(x).chunk(2, dim=-1)
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
            return self.stacked_product(x).split((q_size, kv_size, kv_size), dim=-1)
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
             lengths: torch.Tensor | None = None, pages: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row: x [N, H], positions [N]; writes k/v at (rows, positions) of the pools
        [R, kv_heads, L, D] in place, then attends over the row's cache. -> [N, H]. `lengths` =
        positions + 1 if the caller has it (the backbone computes it once for all layers). Paged pools with
        their table `pages` (ops/kv_pages.py)."""
        n = x.shape[0]
        cos, sin = self.rotary(positions[:, None], rope)
        q, k, v = self.qkv(x)
        heads = (n, 1, self.num_kv_heads, self.head_dim)
        # q normed and rotated, and k likewise with v straight into the pools: one kernel on the GPU
        # (ops/rmsnorm.py; q and k share the config's eps and, here, the head count)
        q = rms_norm_rope_qk_store(q.view(n, 1, self.num_heads, self.head_dim), self.q_norm.weight, k.view(heads),
                                   self.k_norm.weight, self.k_norm.eps, cos, sin, v.view(heads), pool_k, pool_v,
                                   rows, positions, pages=pages)
        lengths = positions + 1 if lengths is None else lengths
        out = decode_attention(q[:, 0], pool_k, pool_v, rows, lengths, self.scale, self.window, pages=pages)
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

    def step(self, x, h, following, positions, pool_k, pool_v, rows, rope=None, lengths=None, pages=None):
        """x [N, H] the residual stream, h = input_layernorm(x) -> (the new x, following(x)): each residual
        add runs with the next norm (`add_to_then`); `following` is the next layer's input_layernorm or
        the backbone's final norm."""
        attn = self.self_attn.step(h, positions, pool_k, pool_v, rows, rope, lengths, pages)
        x, h = self.post_attention_layernorm.add_to_then(x, attn, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm.add_to_then(x, self.mlp(h), following)


def talker_pool_page(stream: int, page: int, num_pages: int) -> int:
    """The pool row of CFG stream `stream`'s page `page` in a paged talker pool of num_pages pages per stream
    (page num_pages is the stream's sink): the streams' pages lie one after the other, num_pages + 1 each, so
    serving/pages.py hands out stream 0's page numbers and stream 1 reads the same page of its own half."""
    return stream * (num_pages + 1) + page


@dataclass
class TalkerCache:
    """Backbone KV pools: k, v [n_layers, 2, S, kv_heads, max_len, head_dim]; dim 1 is the CFG stream
    (0 = conditional, 1 = unconditional), dim 2 the slot (the last slot is the sink). Paged: k, v
    [n_layers, 2, pages, kv_heads, page_len, head_dim] and `pages` [2 * S, max_len / page_len] int32, the
    table of each stream's row (row = stream * S + slot, as the unpaged views below number them) into the
    layer's two streams' pages (talker_pool_page; serving/pages.py hands them out)."""
    k: torch.Tensor
    v: torch.Tensor
    pages: torch.Tensor | None = None

    @property
    def num_slots(self) -> int:
        return self.k.shape[2] if self.pages is None else self.pages.shape[0] // 2

    def layer_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [2 * S, kv_heads, max_len, D] of one layer: row = stream * S + slot (paged: the two streams'
        pages, [2 * pages, kv_heads, page_len, D])."""
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
            x, h = layer.step(x, h, following, positions, pool_k, pool_v, rows, ropes[attn.rope_theta], lengths,
                              cache.pages)
        return h
