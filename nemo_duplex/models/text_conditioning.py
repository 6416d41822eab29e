"""How text enters the EAR-TTS talker (MODEL_SPEC sections 4.2.2, 4.2.3): the char-aware subword encoder
(a 1-layer T5Gemma encoder over a token's characters) with its continuation and BOS/EOS flag embeddings,
then the gated fusion of that text embedding with the code embedding into the backbone's input.
"""
from __future__ import annotations

import torch
from torch import nn

from nemo_duplex.models.config import CASConfig
from nemo_duplex.models.gemma import GatedMLP, GemmaRMSNorm, apply_rotary, attention_projections, rotary_cos_sin

# ---------------------------------------------------------------------------------------------------------
# Char-aware subword encoder (spec 4.2.2)


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
