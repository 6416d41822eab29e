"""Nemotron-H backbone (Nemotron Nano V2 9B) of VoiceChat: Mamba-2, NoPE GQA attention and relu^2 MLP
layers, each a pre-norm residual block, then norm_f (spec 3.1-3.7).

Checkpoint keys (prefix `stt_model.llm.`, spec 6.3) are the module paths: `layers.{i}.norm.weight`,
`layers.{i}.mixer.*`, `norm_f.weight`. The embedding and the heads live outside (model.py).

Three ways to run it:
  * `forward(x)`: the whole sequence from an empty state, no cache (the offline reference, spec 3.7);
  * `prefill(x, cache, slots, lengths)`: T tokens per row continuing from the rows' slots;
  * `step(x, cache, slots, lengths)`: one token per row over the slot pools, in place; either plain torch
    (gather rows, compute, scatter back) or the Triton ops (`ops/mamba_step.py`, `ops/decode_attention.py`).
Per-call state is an `LLMCache` of pools whose slot dim has max_calls + 1 rows, the last being the sink
that padding rows of a captured batch point at (docs/design.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nemo_duplex.models.config import LLMConfig
from nemo_duplex.models.stacking import StackedProjections
from ops.activation import relu_square
from ops.decode_attention import decode_attention
from ops.kv_pages import kv_gather, kv_max_len, kv_write
from ops.mamba_step import mamba_step
from ops.rmsnorm import add_rms_norm, rms_norm

MAMBA, ATTENTION, MLP_KIND = "M", "*", "-"  # hybrid_override_pattern letters (spec 3.2)


@dataclass
class LLMCache:
    """Slot pools for all layers. Mamba: the last K-1 raw (pre-conv) xBC columns and the SSM state;
    attention: keys/values by absolute position (NoPE, so entries never need re-rotating), one row per slot
    or, paged, in pages that a slot's row of `pages` names (ops/kv_pages.py; serving/pages.py hands them out)."""
    conv: torch.Tensor  # [n_mamba, S, conv_dim, K-1], compute dtype
    ssm: torch.Tensor   # [n_mamba, S, heads, head_dim, d_state], fp32 by default (spec 1.6)
    k: torch.Tensor     # [n_attn, S, kv_heads, max_len, head_dim], compute dtype; paged [n_attn, pages, kv, page_len, D]
    v: torch.Tensor     # as k
    pages: torch.Tensor | None = None   # paged: [S, max_len / page_len] int32, the pool page of each stretch

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    @property
    def max_len(self) -> int:
        return kv_max_len(self.k[0], self.pages)


def reset_slots(cache: LLMCache, slots: torch.Tensor) -> None:
    """Empty the recurrent state of `slots` for a new call. K/V need no clearing: positions at or past a
    row's length are never read (both attention paths mask them, values included)."""
    cache.conv[:, slots] = 0
    cache.ssm[:, slots] = 0


# ----------------------------------------------------------------------------------------------------
# Norms
# ----------------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * w, in fp32, plain weight (not 1 + w) (spec 3.2)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # one kernel on CUDA; ops/rmsnorm.py's reference otherwise


class GatedRMSNorm(nn.Module):
    """Mamba-2 output norm: y * SiLU(z) first (norm_before_gate = False), then RMS over each group of
    d_inner / n_groups channels separately (1280 at full size), times the weight. fp32 (spec 3.3)."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return rms_norm(y, self.weight, self.eps, gate=z, group_size=self.group_size, out_dtype=out_dtype)


# ----------------------------------------------------------------------------------------------------
# Mixers
# ----------------------------------------------------------------------------------------------------

def ssm_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-2 recurrence, one position at a time, fp32 (spec 3.3):
    S_t = exp(dt_t A) S_{t-1} + dt_t x_t (outer) B_t;  y_t = S_t C_t + D x_t.
    x [b, T, heads, p], dt [b, T, heads] (after softplus), A/D [heads], B/C [b, T, heads, n] (already
    expanded from groups), state [b, heads, p, n]. Returns y [b, T, heads, p] and the final state."""
    decay = torch.exp(dt * A)  # [b, T, heads]
    dtx = dt[..., None] * x
    ys = []
    for t in range(x.shape[1]):
        state = state * decay[:, t, :, None, None] + dtx[:, t, :, :, None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    y = torch.stack(ys, dim=1) + D[:, None] * x
    return y, state


def ssm_scan_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                     D: torch.Tensor, state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """`ssm_scan` in Mamba-2's chunked (SSD) form, the same recurrence as a few matrix products per chunk of
    `chunk` positions instead of T sequential steps (a prompt's prefill: 27 layers x T small launches
    otherwise, ~0.1 s per 128 tokens on an H200, all host time). Within a chunk, with a_t = dt_t A and
    c_t = a_1 + ... + a_t:
        y_t = sum_{s<=t} exp(c_t - c_s) (C_t . B_s) dt_s x_s + exp(c_t) S_0 C_t + D x_t
        S_T = exp(c_T) S_0 + sum_s exp(c_T - c_s) dt_s x_s (outer) B_s
    fp32 throughout; equal to `ssm_scan` within float rounding (tests/test_llm.py)."""
    ys = []
    for start in range(0, x.shape[1], chunk):
        xs, dts = x[:, start: start + chunk], dt[:, start: start + chunk]
        Bs, Cs = B[:, start: start + chunk], C[:, start: start + chunk]
        cum = torch.cumsum(dts * A, dim=1)                                   # [b, t, heads]
        seg = cum[:, :, None, :] - cum[:, None, :, :]                        # [b, t, s, heads]: c_t - c_s
        causal = torch.ones(seg.shape[1], seg.shape[2], dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(seg.masked_fill(~causal[None, :, :, None], float("-inf")))
        dtx = dts[..., None] * xs                                            # [b, t, heads, p]
        weights = decay * torch.einsum("bthn,bshn->btsh", Cs, Bs)
        y = torch.einsum("btsh,bshp->bthp", weights, dtx)
        y = y + torch.einsum("bhpn,bthn->bthp", state, Cs) * torch.exp(cum)[..., None]
        ys.append(y + D[:, None] * xs)
        to_end = torch.exp(cum[:, -1:, :] - cum)                             # [b, s, heads]: exp(c_T - c_s)
        state = state * torch.exp(cum[:, -1])[..., None, None] + torch.einsum("bsh,bshp,bshn->bhpn", to_end, dtx, Bs)
    return torch.cat(ys, dim=1), state


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.num_heads = cfg.mamba_num_heads
        self.head_dim = cfg.mamba_head_dim
        self.d_state = cfg.ssm_state_size
        self.n_groups = cfg.n_groups
        self.d_inner = cfg.mamba_d_inner  # heads x head_dim, not expand x hidden (spec 3.1)
        self.conv_dim = cfg.mamba_conv_dim
        self.kernel = cfg.conv_kernel
        # in_proj output order: z | xBC | dt (spec 3.3)
        self.in_proj = nn.Linear(cfg.hidden_size, self.d_inner + self.conv_dim + self.num_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.norm = GatedRMSNorm(self.d_inner, self.d_inner // self.n_groups, cfg.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.d_inner, cfg.hidden_size, bias=False)

    def _split_proj(self, proj: torch.Tensor):
        return proj.split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)  # z, xBC, dt_raw

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor | None = None,
                ssm_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, T, H] continuing from conv_state [b, conv_dim, K-1] and ssm_state [b, heads, p, n]
        (zeros when None). Returns (out [b, T, H], new conv_state (x's dtype), new ssm_state (fp32))."""
        b, T, _ = x.shape
        z, xBC, dt_raw = self._split_proj(self.in_proj(x))
        if conv_state is None:
            conv_state = x.new_zeros(b, self.conv_dim, self.kernel - 1)
        if ssm_state is None:
            ssm_state = x.new_zeros(b, self.num_heads, self.head_dim, self.d_state, dtype=torch.float32)

        # causal depthwise conv over [state | new]: a valid conv gives exactly T outputs
        window = torch.cat([conv_state.to(x.dtype), xBC.transpose(1, 2)], dim=-1)  # [b, conv_dim, K-1+T]
        new_conv_state = window[:, :, -(self.kernel - 1):]
        conv = F.conv1d(window.float(), self.conv1d.weight.float(), self.conv1d.bias.float(), groups=self.conv_dim)
        xBC = F.silu(conv).to(x.dtype).transpose(1, 2).float()  # stored in the compute dtype, scanned in fp32

        xs, B, C = xBC.split([self.d_inner, self.n_groups * self.d_state, self.n_groups * self.d_state], dim=-1)
        heads_per_group = self.num_heads // self.n_groups
        # head h reads group h // heads_per_group (repeat_interleave; spec 3.3 warns against h % groups)
        B = B.unflatten(-1, (self.n_groups, self.d_state)).repeat_interleave(heads_per_group, dim=2)
        C = C.unflatten(-1, (self.n_groups, self.d_state)).repeat_interleave(heads_per_group, dim=2)
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())  # no clamp: time_step_limit (0, inf) (spec 12.6)
        A = -torch.exp(self.A_log.float())
        scan = ssm_scan if T == 1 else ssm_scan_chunked   # one position (the reference step): the plain recurrence
        y, new_ssm_state = scan(xs.unflatten(-1, (self.num_heads, self.head_dim)), dt, A, B, C,
                                self.D.float(), ssm_state.float())
        out = self.out_proj(self.norm(y.flatten(-2), z).to(x.dtype))
        return out, new_conv_state, new_ssm_state

    def step(self, x: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor, slots: torch.Tensor,
             use_kernels: bool) -> torch.Tensor:
        """x [B, H]: one token per row; conv_pool [S, conv_dim, K-1], ssm_pool [S, heads, p, n] updated in place."""
        if not use_kernels:  # reference: gather the rows, run one position, scatter back
            out, conv_state, ssm_state = self.forward(x[:, None], conv_pool[slots], ssm_pool[slots])
            conv_pool[slots] = conv_state.to(conv_pool.dtype)
            ssm_pool[slots] = ssm_state.to(ssm_pool.dtype)
            return out[:, 0]
        z, xBC, dt_raw = self._split_proj(self.in_proj(x))
        y = mamba_step(xBC, dt_raw, conv_pool, ssm_pool, slots, self.conv1d.weight, self.conv1d.bias,
                       self.A_log, self.D, self.dt_bias, self.n_groups)
        return self.out_proj(self.norm(y, z, x.dtype))


class Attention(StackedProjections):
    """Causal GQA attention with no positional encoding at all (NoPE), no bias, scale 1/sqrt(head_dim) (spec 3.4).
    Once stacked (`stack_projections`), q/k/v are one GEMM whose column blocks are read in place."""
    stacked = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def _qkv(self, x: torch.Tensor):
        if self.stack is not None:
            q_width, kv_width = self.num_heads * self.head_dim, self.kv_heads * self.head_dim
            q, k, v = self.stacked_product(x).split([q_width, kv_width, kv_width], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.unflatten(-1, (self.num_heads, self.head_dim)), k.unflatten(-1, (self.kv_heads, self.head_dim)),
                v.unflatten(-1, (self.kv_heads, self.head_dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, T, H], the whole sequence from position 0."""
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x))  # [b, heads, T, d]
        group = self.num_heads // self.kv_heads  # query head h uses kv head h // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).flatten(-2))

    def prefill(self, x: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                lengths: torch.Tensor, pages: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, T, H] at positions lengths[r] .. lengths[r] + T - 1 of slot slots[r]: write the new keys and
        values into the pools, then attend over each row's whole history (plain torch, fp32 softmax)."""
        b, T, _ = x.shape
        q, k, v = self._qkv(x)
        pos = lengths[:, None] + torch.arange(T, device=x.device)  # [b, T]
        kv_write(k_pool, pages, slots[:, None], pos, k)            # [b, T, kv, d] at (slot, :, position)
        kv_write(v_pool, pages, slots[:, None], pos, v)

        group = self.num_heads // self.kv_heads
        keys = kv_gather(k_pool, pages, slots).float().repeat_interleave(group, dim=1)  # [b, heads, L, d]
        values = kv_gather(v_pool, pages, slots).float().repeat_interleave(group, dim=1)
        valid = torch.arange(keys.shape[2], device=x.device)[None, None, :] <= pos[:, :, None]  # [b, T, L]
        scores = torch.einsum("bthd,bhld->bhtl", q.float(), keys) * self.scale
        probs = torch.softmax(scores.masked_fill(~valid[:, None], float("-inf")), dim=-1)
        values = values.masked_fill(~valid.any(1)[:, None, :, None], 0.0)  # never-written positions may hold junk
        out = torch.einsum("bhtl,bhld->bthd", probs, values).to(x.dtype)
        return self.o_proj(out.flatten(-2))

    def step(self, x: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
             lengths: torch.Tensor, use_kernels: bool, pages: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, H], one token per row at position lengths[r]."""
        if not use_kernels:
            return self.prefill(x[:, None], k_pool, v_pool, slots, lengths, pages)[:, 0]
        q, k, v = self._qkv(x)
        kv_write(k_pool, pages, slots, lengths, k)  # [B, kv, d] at (slot, :, position)
        kv_write(v_pool, pages, slots, lengths, v)
        out = decode_attention(q.to(k_pool.dtype), k_pool, v_pool, slots, lengths + 1, self.scale, pages=pages)
        return self.o_proj(out.to(x.dtype).flatten(-2))


class MLP(nn.Module):
    """down_proj(relu(up_proj(x))^2), no gate, no bias (spec 3.5); relu^2 is one kernel on the GPU."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu_square(self.up_proj(x)))


# ----------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-norm residual block: h + mixer(RMSNorm(h)) (spec 3.2). `kind` is the pattern letter."""

    def __init__(self, cfg: LLMConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(cfg)
        elif kind == ATTENTION:
            self.mixer = Attention(cfg)
        elif kind == MLP_KIND:
            self.mixer = MLP(cfg)
        else:
            raise ValueError(f"unknown layer letter {kind!r} in hybrid_override_pattern (expected M, * or -)")


class NemotronH(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.use_kernels = False   # the step's path, chosen once at load (VoiceChat.cast_for_inference)
        self.cfg = cfg
        self.layers = nn.ModuleList(Block(cfg, kind) for kind in cfg.hybrid_override_pattern)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        # layer index -> row of its pool in LLMCache (Mamba layers and attention layers counted separately)
        self.pool_row = {i: j for kind in (MAMBA, ATTENTION) for j, i in enumerate(cfg.layer_indices(kind))}

    # ---- full sequence, no cache (the offline reference) ----

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> h [B, T, H] after norm_f, causal over the whole sequence from an empty state."""
        for layer in self.layers:
            h = layer.norm(x)
            if layer.kind == MAMBA:
                h = layer.mixer(h)[0]
            else:
                h = layer.mixer(h)
            x = x + h
        return self.norm_f(x)

    # ---- slot pools ----

    def allocate_cache(self, num_slots: int, max_len: int, device: torch.device | str, dtype: torch.dtype,
                       ssm_dtype: torch.dtype = torch.float32, page_len: int | None = None,
                       num_pages: int = 0) -> LLMCache:
        """Zeroed pools; num_slots = max_calls + 1 (the last row is the sink). With page_len: the attention
        pools hold num_pages pages of page_len positions and one more, the sink page, which every entry of
        the table names until a page is given (serving/pages.py)."""
        cfg = self.cfg
        n_mamba, n_attn = len(cfg.layer_indices(MAMBA)), len(cfg.layer_indices(ATTENTION))
        rows, length, pages = num_slots, max_len, None
        if page_len is not None:
            rows, length = num_pages + 1, page_len
            pages = torch.full((num_slots, -(-max_len // page_len)), num_pages, dtype=torch.int32, device=device)
        kv = (n_attn, rows, cfg.num_key_value_heads, length, cfg.head_dim)
        return LLMCache(
            conv=torch.zeros(n_mamba, num_slots, cfg.mamba_conv_dim, cfg.conv_kernel - 1, device=device, dtype=dtype),
            ssm=torch.zeros(n_mamba, num_slots, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size,
                            device=device, dtype=ssm_dtype),
            k=torch.zeros(kv, device=device, dtype=dtype), v=torch.zeros(kv, device=device, dtype=dtype), pages=pages)

    def reset_slots(self, cache: LLMCache, slots: torch.Tensor) -> None:
        reset_slots(cache, slots)

    def prefill(self, x: torch.Tensor, cache: LLMCache, slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """x [B, T, H]: T tokens per row, row r continuing slot slots[r] at position lengths[r] (e.g. the
        system prompt, spec 3.7). Updates the pools in place; returns h [B, T, H] after norm_f."""
        for i, layer in enumerate(self.layers):
            h = layer.norm(x)
            if layer.kind == MAMBA:
                j = self.pool_row[i]
                h, conv_state, ssm_state = layer.mixer(h, cache.conv[j][slots], cache.ssm[j][slots])
                cache.conv[j][slots] = conv_state.to(cache.conv.dtype)
                cache.ssm[j][slots] = ssm_state.to(cache.ssm.dtype)
            elif layer.kind == ATTENTION:
                j = self.pool_row[i]
                h = layer.mixer.prefill(h, cache.k[j], cache.v[j], slots, lengths, cache.pages)
            else:
                h = layer.mixer(h)
            x = x + h
        return self.norm_f(x)

    def step(self, x: torch.Tensor, cache: LLMCache, slots: torch.Tensor, lengths: torch.Tensor,
             use_kernels: bool | None = None) -> torch.Tensor:
        """x [B, H]: one token per row. Row r's attention pools hold lengths[r] earlier tokens of slot
        slots[r]; the new k/v go to position lengths[r] and the conv/SSM rows are updated in place.
        use_kernels: the Triton ops' path, or the plain torch gather/compute/scatter one; None = the choice
        made at load (`self.use_kernels`, VoiceChat.cast_for_inference: the kernels where the weights are on
        CUDA). Returns h [B, H] after norm_f. The caller advances lengths."""
        if use_kernels is None:
            use_kernels = self.use_kernels
        h = self.layers[0].norm(x)
        for i, layer in enumerate(self.layers):
            if layer.kind == MAMBA:
                j = self.pool_row[i]
                h = layer.mixer.step(h, cache.conv[j], cache.ssm[j], slots, use_kernels)
            elif layer.kind == ATTENTION:
                j = self.pool_row[i]
                h = layer.mixer.step(h, cache.k[j], cache.v[j], slots, lengths, use_kernels, cache.pages)
            else:
                h = layer.mixer(h)
            # the residual add and the next block's norm (or norm_f) in one kernel on CUDA: x + h, norm(x + h)
            following = self.layers[i + 1].norm if i + 1 < len(self.layers) else self.norm_f
            x, h = add_rms_norm(x, h, following.weight, following.eps)
        return h

    # ---- random weights ----

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Seeded random weights keeping activations O(1): linear weights N(0, 1/fan_in), the residual
        branch outputs (out_proj, o_proj, down_proj) further scaled by 1/sqrt(num_layers); A_log = log U[1, 16];
        softplus(dt_bias) log-uniform in [1e-2, 1e-1]; D ~ 1; norm weights 1 + small noise."""
        def draw(shape, kind="normal", low=0.0, high=1.0):
            t = torch.empty(shape, device=generator.device)
            return t.normal_(generator=generator) if kind == "normal" else t.uniform_(low, high, generator=generator)

        residual_scale = 1.0 / math.sqrt(self.cfg.num_layers)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 2)[-2:]  # e.g. ["in_proj", "weight"] or ["mixer", "A_log"]
            if leaf[-1] == "A_log":
                value = torch.log(draw(p.shape, "uniform", 1.0, 16.0))
            elif leaf[-1] == "dt_bias":
                dt = torch.exp(draw(p.shape, "uniform", math.log(1e-2), math.log(1e-1)))
                value = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
            elif leaf[-1] == "D":
                value = 1.0 + 0.1 * draw(p.shape)
            elif leaf[0] in ("norm", "norm_f"):
                value = 1.0 + 0.1 * draw(p.shape)
            elif leaf == ["conv1d", "weight"]:
                value = draw(p.shape) / math.sqrt(p.shape[-1])
            elif leaf == ["conv1d", "bias"]:
                value = 0.1 * draw(p.shape)
            elif p.dim() == 2:
                value = draw(p.shape) / math.sqrt(p.shape[1])
                if leaf[0] in ("out_proj", "o_proj", "down_proj"):
                    value = value * residual_scale
            else:
                raise AssertionError(f"init_weights has no rule for {name}")
            p.copy_(value.to(p.device, p.dtype))
        for name, b in self.named_buffers():
            raise AssertionError(f"init_weights has no rule for buffer {name}")
