"""The EAR-TTS talker's output side (MODEL_SPEC sections 4.5, 4.6): the Mixture-of-Gaussians head that maps
the backbone output to a latent's distribution, the top-k filter of its component logits, and the greedy
residual quantisation of a drawn latent into RVQ codes.
"""
from __future__ import annotations

import torch
from torch import nn

from nemo_duplex.models.config import MoGConfig
from nemo_duplex.models.gemma import GatedMLP, GemmaRMSNorm
from nemo_duplex.models.stacking import StackedProjections
from ops.argmin_residual import argmin_residual
from ops.rmsnorm import add_rms_norm


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
        out = self.stacked_product(x)
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
