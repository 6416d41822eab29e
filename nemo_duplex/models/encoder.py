"""Cache-aware FastConformer speech encoder and `Perception` (front end + encoder + proj), spec 2.

Two ways to run it, equal frame for frame (tests/test_encoder.py):
* offline: `Perception.forward(audio, lengths)` over whole clips, with the [70, 0] chunked_limited
  attention mask (spec 2.6), causal convolutions and causal dw-striding subsampling (spec 2.2);
* streaming: `Perception.stream_step(chunk, state, slots)`, one 1280-sample chunk -> one encoder frame
  per call, batched over calls at different frame indices, state in an `EncoderStreamState` pool.

Streaming geometry (docs/design.md): step k uses the 17 mel columns 8k-16 .. 8k (9 cached + 8 new);
activations whose global time index is negative are zeroed before each stride-2 convolution, which is
exactly the offline causal zero padding, and the last subsampled frame is kept. NeMo's own step zero-fills
*mel* instead, which differs from its offline output over the first ~70 frames (spec 12.2); the offline
encoder defines the right answer.

Module attribute names are the official checkpoint keys under `stt_model.perception.` (spec 6.3).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nemo_duplex.models.config import EncoderConfig, FrontendConfig
from nemo_duplex.models.frontend import MelFrontend
from nemo_duplex.models.stacking import StackedProjections
from ops.bounded_attention import bounded_attention_and_store
from ops.conformer_conv import conformer_conv_step
from ops.layernorm import add_layer_norm, add_layer_norm_then

LAYER_NORM_EPS = 1e-5
MASKED_SCORE = -10000.0  # NeMo's fill value for masked attention scores (spec 2.4)


# ---------------------------------------------------------------------------------------------
# Helpers

def relative_position_table(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """Transformer-XL sinusoids (spec 2.4): positions [n] -> [n, d_model] fp32,
    pe[p, 2i] = sin(p w_i), pe[p, 2i+1] = cos(p w_i), w_i = exp(-2i ln(10000) / d_model)."""
    freqs = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32, device=positions.device)
                      * -(math.log(10000.0) / d_model))
    angles = positions.float()[:, None] * freqs[None, :]
    return torch.stack([torch.sin(angles), torch.cos(angles)], dim=-1).flatten(1)


def rel_shift(x: torch.Tensor) -> torch.Tensor:
    """[..., Lq, Lp] scores against positions Lq-1 .. -(Lp-Lq) -> entry [i, j] holds position i - j
    (spec 2.4): left-pad one zero column, view as [Lp+1, Lq], drop the first row, view back."""
    *lead, q_len, pos_len = x.shape
    x = F.pad(x, (1, 0))
    return x.view(*lead, pos_len + 1, q_len)[..., 1:, :].reshape(*lead, q_len, pos_len)


def chunked_limited_mask(lengths: torch.Tensor, max_len: int, left: int, right: int = 0) -> torch.Tensor:
    """Offline attention mask (spec 2.6): [B, T, T] bool, True where query i may attend key j.
    Chunks of right+1 frames; a chunk sees itself and left // (right+1) chunks before it; both frames
    must lie inside the row's valid length. With [70, 0]: 0 <= i - j <= 70."""
    chunk = right + 1
    frame = torch.arange(max_len, device=lengths.device)
    chunk_index = torch.div(frame, chunk, rounding_mode="floor")
    diff = chunk_index[:, None] - chunk_index[None, :]
    allowed = (diff >= 0) & (diff <= left // chunk)
    valid = frame[None, :] < lengths[:, None]
    return allowed[None] & valid[:, :, None] & valid[:, None, :]


def subsampled_lengths(lengths: torch.Tensor, stages: int) -> torch.Tensor:
    """Causal k3/s2 conv with pads (2, 1), per stage: L -> floor(L / 2) + 1 (spec 2.2)."""
    for _ in range(stages):
        lengths = torch.div(lengths, 2, rounding_mode="floor") + 1
    return lengths


def _fill_normal_(tensor: torch.Tensor, std: float, generator: torch.Generator, mean: float = 0.0) -> None:
    draw = torch.randn(tensor.shape, generator=generator, device=generator.device) * std + mean
    with torch.no_grad():
        tensor.copy_(draw.to(tensor.device, tensor.dtype))


# ---------------------------------------------------------------------------------------------
# Blocks

class ConvSubsampling(nn.Module):
    """dw_striding x8, causal on time and frequency (spec 2.2). `conv` indices are checkpoint indices:
    0 conv, 1 relu, 2 depthwise, 3 pointwise, 4 relu, 5 depthwise, 6 pointwise, 7 relu."""

    def __init__(self, cfg: EncoderConfig, feat_in: int):
        super().__init__()
        if cfg.subsampling_factor != 8:
            raise ValueError("the checkpoint layout has three stride-2 stages: subsampling_factor must be 8")
        c = cfg.subsampling_conv_channels
        self.conv = nn.Sequential(
            nn.Conv2d(1, c, 3, stride=2), nn.ReLU(),
            nn.Conv2d(c, c, 3, stride=2, groups=c), nn.Conv2d(c, c, 1), nn.ReLU(),
            nn.Conv2d(c, c, 3, stride=2, groups=c), nn.Conv2d(c, c, 1), nn.ReLU(),
        )
        freq = feat_in
        for _ in range(3):
            freq = freq // 2 + 1
        self.out = nn.Linear(c * freq, cfg.d_model)

    @staticmethod
    def keep_mask(x: torch.Tensor, lengths: torch.Tensor | None, first_index: torch.Tensor | None):
        """[B, T] bool: time steps of x [B, C, T, F] that hold signal. Offline: t < length (NeMo 3.0.0's
        MaskedConvSequential zeroes the rest, so padded batch rows equal single rows). Streaming: global
        index first_index + t >= 0 (the offline causal zero padding before the call's start)."""
        t = torch.arange(x.shape[2], device=x.device)[None, :]
        if first_index is not None:
            return first_index[:, None] + t >= 0
        return t < lengths[:, None]

    def forward(self, mel: torch.Tensor, lengths: torch.Tensor | None = None,
                first_index: torch.Tensor | None = None) -> torch.Tensor:
        """mel [B, T, n_mels] -> [B, T', d_model]. Pass one of: offline `lengths` [B] valid mel columns;
        streaming `first_index` [B] global mel column of mel[:, 0] (even).
        Before each stride-2 conv the time steps outside the signal are zeroed, then padded (2 left,
        1 right) on time and frequency (CausalConv2D)."""
        conv = self.conv
        x = mel[:, None]
        for strided, rest in ((conv[0], (conv[1],)), (conv[2], (conv[3], conv[4])), (conv[5], (conv[6], conv[7]))):
            x = x.masked_fill(~self.keep_mask(x, lengths, first_index)[:, None, :, None], 0.0)
            x = strided(F.pad(x, (2, 1, 2, 1)))
            for module in rest:
                x = module(x)
            # Output i reads inputs 2i-2 .. 2i: length L -> L // 2 + 1, global index of output 0 = first / 2.
            if first_index is not None:
                first_index = torch.div(first_index, 2, rounding_mode="floor")
            else:
                lengths = subsampled_lengths(lengths, 1)
        if first_index is None:
            x = x.masked_fill(~self.keep_mask(x, lengths, None)[:, None, :, None], 0.0)
        b, c, t, f = x.shape
        return self.out(x.transpose(1, 2).reshape(b, t, c * f))


class ConformerFeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff, bias=False)
        self.linear2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.silu(self.linear1(x)))


class RelPositionMultiHeadAttention(StackedProjections):
    """Transformer-XL relative-position attention (spec 2.4), no biases in the linears. Once streaming
    (`prepare_stream`), q/k/v are one weight tensor, `stack` (nemo_duplex/models/stacking.py): one GEMM per step."""
    stacked = ("linear_q", "linear_k", "linear_v")

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d, h = cfg.d_model, cfg.n_heads
        self.n_heads, self.head_dim, self.window = h, cfg.head_dim, cfg.att_context_left
        self.linear_q = nn.Linear(d, d, bias=False)
        self.linear_k = nn.Linear(d, d, bias=False)
        self.linear_v = nn.Linear(d, d, bias=False)
        self.linear_out = nn.Linear(d, d, bias=False)
        self.linear_pos = nn.Linear(d, d, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(h, cfg.head_dim))
        self.pos_bias_v = nn.Parameter(torch.empty(h, cfg.head_dim))
        # Streaming table, derived from the weights, so not in the state_dict; `prepare_stream` fills it
        # and loading a state_dict empties it: P[d] = linear_pos(pe(d)) for d = 0..W, [W+1, H, Dh].
        # (The q/k/v stack needs no such care: its blocks ARE the three weights, so a load writes into it.)
        self.register_buffer("pos_by_distance", torch.empty(0), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.clear_stream_tables())

    def clear_stream_tables(self):
        self.pos_by_distance = torch.empty(0, device=self.linear_pos.weight.device)

    @torch.no_grad()
    def prepare_stream(self):
        weight = self.linear_pos.weight
        distances = torch.arange(self.window + 1, device=weight.device)
        pe = relative_position_table(distances, weight.shape[1]).to(weight.dtype)
        self.pos_by_distance = self.linear_pos(pe).view(-1, self.n_heads, self.head_dim)
        if self.stack is None:  # once: re-stacking would move the weights a captured graph reads
            self.stack_projections()

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, d] -> [B, H, T, Dh]
        return x.view(x.shape[0], x.shape[1], self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, d]; pos_emb [2T-1, d] for positions T-1 .. -(T-1); mask [B, T, T] True = attend."""
        b, t, _ = x.shape
        q, k, v = self.split_heads(self.linear_q(x)), self.split_heads(self.linear_k(x)), self.split_heads(self.linear_v(x))
        p = self.linear_pos(pos_emb.to(x.dtype)).view(-1, self.n_heads, self.head_dim).transpose(0, 1)  # [H, 2T-1, Dh]
        content = torch.matmul(q + self.pos_bias_u[:, None], k.transpose(-2, -1))
        position = rel_shift(torch.matmul(q + self.pos_bias_v[:, None], p.transpose(-2, -1)))[..., :t]
        scores = (content + position) / math.sqrt(self.head_dim)
        blocked = ~mask[:, None]
        probs = torch.softmax(scores.masked_fill(blocked, MASKED_SCORE), dim=-1).masked_fill(blocked, 0.0)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1)
        return self.linear_out(out)

    def step(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
             t: torch.Tensor) -> torch.Tensor:
        """x [B, d] (frame t of each row); keys/values [S, W, H, Dh]: this layer's ring windows, the new
        frame's k/v are written at ring = t % W after attending (ops/bounded_attention.py)."""
        b = x.shape[0]
        # q, k, v from one GEMM over the stacked weight (prepare_stream); strided views, no copies
        q, k, v = self.stacked_product(x).view(b, 3, self.n_heads, self.head_dim).unbind(1)
        out = bounded_attention_and_store(q, k, v, keys, values, self.pos_by_distance, self.pos_bias_u,
                                          self.pos_bias_v, slots, t)
        return self.linear_out(out.reshape(b, -1))


class ConformerConvolution(nn.Module):
    """pointwise -> GLU -> causal depthwise (k9) -> LayerNorm (named batch_norm) -> SiLU -> pointwise (spec 2.5)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d, k = cfg.d_model, cfg.conv_kernel_size
        self.context = k - 1
        self.pointwise_conv1 = nn.Conv1d(d, 2 * d, 1, bias=False)
        self.depthwise_conv = nn.Conv1d(d, d, k, groups=d, bias=False)
        self.batch_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)  # conv_norm_type layer_norm (spec 2.3)
        self.pointwise_conv2 = nn.Conv1d(d, d, 1, bias=False)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """Depthwise output [B, d, T] -> block output [B, T, d]."""
        x = F.silu(self.batch_norm(x.transpose(1, 2)))
        return self.pointwise_conv2(x.transpose(1, 2)).transpose(1, 2)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, d], pad_mask [B, T] True beyond the valid length."""
        x = F.glu(self.pointwise_conv1(x.transpose(1, 2)), dim=1)
        x = x.masked_fill(pad_mask[:, None, :], 0.0)
        return self.finish(self.depthwise_conv(F.pad(x, (self.context, 0))))

    def step(self, x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """x [B, d]; cache [S, d, k-1]: this layer's last k-1 GLU outputs per slot, oldest first.
        One frame: the k=1 convolutions are plain GEMMs over [B, d] (no conv kernels, no layout copies);
        between them GLU, the cache shift, the depthwise conv, LayerNorm and SiLU are one kernel
        (ops/conformer_conv.py)."""
        h = F.linear(x, self.pointwise_conv1.weight[:, :, 0])  # [B, 2d], GLU's two halves
        norm = self.batch_norm
        y = conformer_conv_step(h, cache, slots, self.depthwise_conv.weight, norm.weight, norm.bias, norm.eps)
        return F.linear(y, self.pointwise_conv2.weight[:, :, 0])


class ConformerLayer(nn.Module):
    """Macaron layer (spec 2.3): half FF, attention, conv, half FF, each pre-normed, then norm_out."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d = cfg.d_model
        d_ff = d * cfg.ff_expansion_factor
        self.norm_feed_forward1 = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.feed_forward1 = ConformerFeedForward(d, d_ff)
        self.norm_self_att = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.self_attn = RelPositionMultiHeadAttention(cfg)
        self.norm_conv = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.conv = ConformerConvolution(cfg)
        self.norm_feed_forward2 = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.feed_forward2 = ConformerFeedForward(d, d_ff)
        self.norm_out = nn.LayerNorm(d, eps=LAYER_NORM_EPS)

    def forward(self, x, pos_emb, mask, pad_mask):
        x = x + 0.5 * self.feed_forward1(self.norm_feed_forward1(x))
        x = x + self.self_attn(self.norm_self_att(x), pos_emb, mask)
        x = x + self.conv(self.norm_conv(x), pad_mask)
        x = x + 0.5 * self.feed_forward2(self.norm_feed_forward2(x))
        return self.norm_out(x)

    def step(self, x, h, following, keys, values, conv_cache, slots, t):
        """forward's blocks for one frame: x [B, d] the layer's input, h = norm_feed_forward1(x) ->
        (the layer's output, following(output)); `following` is the next layer's norm_feed_forward1 (None
        for the last layer: (output, output)). Each block's residual add runs in one kernel with the next
        block's LayerNorm (ops/layernorm.py): `_add_norm` returns the new residual stream x and its norm h,
        the next block's input; the last one also runs `following` on norm_out's output. x + 0.5 * ff is one
        add (alpha): halving is exact, so it rounds as forward's two ops do."""
        x, h = _add_norm(x, self.feed_forward1(h), 0.5, self.norm_self_att)
        x, h = _add_norm(x, self.self_attn.step(h, keys, values, slots, t), 1.0, self.norm_conv)
        x, h = _add_norm(x, self.conv.step(h, conv_cache, slots), 1.0, self.norm_feed_forward2)
        if following is None:
            out = _add_norm(x, self.feed_forward2(h), 0.5, self.norm_out)[1]
            return out, out
        return add_layer_norm_then(x, self.feed_forward2(h), 0.5, self.norm_out.weight, self.norm_out.bias,
                                   self.norm_out.eps, following.weight, following.bias, following.eps)


def _add_norm(x: torch.Tensor, delta: torch.Tensor, alpha: float, norm: nn.LayerNorm):
    """(s, norm(s)) with s = x + alpha * delta, in one kernel (the torch ops on the CPU)."""
    return add_layer_norm(x, delta, alpha, norm.weight, norm.bias, norm.eps)


# ---------------------------------------------------------------------------------------------
# Encoder

class ConformerEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig, feat_in: int):
        super().__init__()
        if cfg.att_context_right != 0:
            raise ValueError("only att_context_size [left, 0] is supported (one frame per 80 ms step)")
        self.cfg = cfg
        self.pre_encode = ConvSubsampling(cfg, feat_in)
        self.layers = nn.ModuleList(ConformerLayer(cfg) for _ in range(cfg.n_layers))

    def forward(self, mel: torch.Tensor, mel_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [B, n_mels, T] -> (enc [B, T', d_model], lengths [B]); T' = 3 x (T -> T//2 + 1)."""
        dtype = self.pre_encode.out.weight.dtype
        x = self.pre_encode(mel.transpose(1, 2).to(dtype), mel_lengths)
        lengths = subsampled_lengths(mel_lengths, 3)
        t = x.shape[1]
        positions = torch.arange(t - 1, -t, -1, device=x.device)
        pos_emb = relative_position_table(positions, self.cfg.d_model)
        mask = chunked_limited_mask(lengths, t, self.cfg.att_context_left, self.cfg.att_context_right)
        pad_mask = torch.arange(t, device=x.device)[None, :] >= lengths[:, None]
        for layer in self.layers:
            x = layer(x, pos_emb, mask, pad_mask)
        return x, lengths

    def step(self, mel: torch.Tensor, frame_index: torch.Tensor, state: "EncoderStreamState",
             slots: torch.Tensor) -> torch.Tensor:
        """mel [B, n_mels, 17] = columns 8k-16 .. 8k of each row's frame k = frame_index -> [B, d_model]."""
        dtype = self.pre_encode.out.weight.dtype
        first_column = frame_index * self.cfg.subsampling_factor - (mel.shape[2] - 1)
        x = self.pre_encode(mel.transpose(1, 2).to(dtype), first_index=first_column)[:, -1]
        h = self.layers[0].norm_feed_forward1(x)
        for i, layer in enumerate(self.layers):
            following = self.layers[i + 1].norm_feed_forward1 if i + 1 < len(self.layers) else None
            x, h = layer.step(x, h, following, state.keys[i], state.values[i], state.conv_cache[i], slots,
                              frame_index)
        return x


@dataclass
class EncoderStreamState:
    """Per-call streaming state, one row per slot (the last row is the sink for padding rows).

    keys/values are ring buffers: frame j of a call sits at position j % W (ops/bounded_attention.py)."""
    audio_tail: torch.Tensor   # [S, tail] fp32 raw samples just before the next chunk (zeros before the call)
    mel_tail: torch.Tensor     # [S, n_mels, 9] fp32 mel columns 8k-8 .. 8k of the last frame k
    frames_done: torch.Tensor  # [S] int64 encoder frames produced = index of the next frame
    keys: torch.Tensor         # [L, S, W, H, Dh] attention keys of the last W frames per layer
    values: torch.Tensor       # [L, S, W, H, Dh]
    conv_cache: torch.Tensor   # [L, S, d_model, kernel-1] last GLU outputs feeding the depthwise conv


class Perception(nn.Module):
    """`stt_model.perception`: preprocessor (mel), encoder (FastConformer), proj (d_model -> LLM width).
    The modality adapter carries no weights and is the identity (spec 2.9)."""

    STREAM_MEL_COLUMNS = 17  # 9 cached + 8 new per 80 ms (spec 2.7, docs/design.md)

    def __init__(self, frontend_cfg: FrontendConfig, encoder_cfg: EncoderConfig):
        super().__init__()
        self.frontend_cfg, self.encoder_cfg = frontend_cfg, encoder_cfg
        self.preprocessor = MelFrontend(frontend_cfg)
        self.encoder = ConformerEncoder(encoder_cfg, frontend_cfg.n_mels)
        self.proj = nn.Linear(encoder_cfg.d_model, encoder_cfg.output_dim)

    def forward(self, audio: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """audio [B, N], lengths [B] -> (enc [B, T, d_model] before proj, enc_lengths [B]).
        N = 1280 K samples give K+1 frames (the last one looks past the audio, spec 2.8)."""
        mel, mel_lengths = self.preprocessor(audio, lengths)
        return self.encoder(mel, mel_lengths)

    def project(self, enc: torch.Tensor) -> torch.Tensor:
        return self.proj(enc)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator):
        """Seeded random weights keeping activations O(1); non-zero biases everywhere, so a wrong
        padding in the streaming path shows up in the tests."""
        self.preprocessor.init_weights(generator)
        for module in list(self.encoder.modules()) + [self.proj]:
            if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
                fan_in = module.weight[0].numel()
                _fill_normal_(module.weight, 1.0 / math.sqrt(fan_in), generator)
                if module.bias is not None:
                    _fill_normal_(module.bias, 0.2, generator)
            elif isinstance(module, nn.LayerNorm):
                _fill_normal_(module.weight, 0.1, generator, mean=1.0)
                _fill_normal_(module.bias, 0.1, generator)
            elif isinstance(module, RelPositionMultiHeadAttention):
                _fill_normal_(module.pos_bias_u, 0.5, generator)
                _fill_normal_(module.pos_bias_v, 0.5, generator)
                module.clear_stream_tables()

    # --- streaming ---------------------------------------------------------------------------------

    def prepare_stream(self):
        """Build the per-layer tables the streaming attention reads, P[d] and the stacked q/k/v weight
        (after the weights are final)."""
        for layer in self.encoder.layers:
            layer.self_attn.prepare_stream()

    def stream_tables_ready(self) -> bool:
        return self.encoder.layers[0].self_attn.pos_by_distance.numel() > 0

    def allocate_stream_state(self, num_slots: int, device, dtype: torch.dtype) -> EncoderStreamState:
        """Zeroed state for `num_slots` rows. Also builds the streaming tables here (as the codec its stacked
        codebooks), before any step is captured or compiled: built at a step's first call inside a
        torch.compile trace they are a graph break that fails the build."""
        if not self.stream_tables_ready():
            self.prepare_stream()
        fe, enc = self.frontend_cfg, self.encoder_cfg
        tail = self.preprocessor.stream_tail_samples(enc.subsampling_factor)
        cached_columns = self.STREAM_MEL_COLUMNS - enc.subsampling_factor
        window = (enc.n_layers, num_slots, enc.att_context_left, enc.n_heads, enc.head_dim)
        return EncoderStreamState(
            audio_tail=torch.zeros(num_slots, tail, device=device),
            mel_tail=torch.zeros(num_slots, fe.n_mels, cached_columns, device=device),
            frames_done=torch.zeros(num_slots, dtype=torch.int64, device=device),
            keys=torch.zeros(window, device=device, dtype=dtype),
            values=torch.zeros(window, device=device, dtype=dtype),
            conv_cache=torch.zeros(enc.n_layers, num_slots, enc.d_model, enc.conv_kernel_size - 1,
                                   device=device, dtype=dtype),
        )

    def reset_slots(self, state: EncoderStreamState, slots: torch.Tensor) -> None:
        """Make `slots` fresh calls: everything zero (ring rows need not be, they are masked by frame count)."""
        state.audio_tail.index_fill_(0, slots, 0.0)
        state.mel_tail.index_fill_(0, slots, 0.0)
        state.frames_done.index_fill_(0, slots, 0)
        state.keys.index_fill_(1, slots, 0.0)
        state.values.index_fill_(1, slots, 0.0)
        state.conv_cache.index_fill_(1, slots, 0.0)

    def stream_step(self, chunk: torch.Tensor, state: EncoderStreamState, slots: torch.Tensor) -> torch.Tensor:
        """chunk [B, 1280] (each row the next 80 ms of its call), slots [B] int64 (distinct, padding rows
        may all point at the sink) -> enc [B, d_model] before proj: frame k = frames_done[slot] of each
        call, equal to offline frame k. Updates the rows `slots` of `state` in place."""
        if not self.stream_tables_ready():   # weights loaded or drawn since the state was allocated
            self.prepare_stream()
        per_step = self.encoder_cfg.subsampling_factor
        frame_index = state.frames_done[slots]
        tail = state.audio_tail[slots]
        new_columns = self.preprocessor.stream_columns(tail, chunk, frame_index, per_step)
        mel = torch.cat([state.mel_tail[slots], new_columns], dim=2)  # columns 8k-16 .. 8k
        state.audio_tail.index_copy_(0, slots, torch.cat([tail, chunk.float()], dim=1)[:, -tail.shape[1]:])
        state.mel_tail.index_copy_(0, slots, mel[:, :, -state.mel_tail.shape[2]:])
        enc = self.encoder.step(mel, frame_index, state, slots)
        state.frames_done.index_copy_(0, slots, frame_index + 1)
        return enc
