"""The LLM's projections with float8 weights (`model.dtype.llm_weights: fp8`, ops/fp8_linear.py).

At load (VoiceChat.cast_for_inference) each Mamba in_proj / out_proj and MLP up_proj / down_proj of the LLM
becomes an `Fp8Linear`: its weight in e4m3 with a scale per output row, each call's rows quantised as they come.
Those are ~7 of the LLM's ~9 billion parameters; the attention layers' stacked q/k/v and o (4 layers), the
embedding and the heads stay in the LLM's dtype. The checkpoint is read as usual first: this is a cast.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ops import check_fp8_device
from ops.fp8_linear import fp8_linear, quantize_weight

FP8_PROJECTIONS = ("in_proj", "out_proj", "up_proj", "down_proj")


class Fp8Linear(nn.Module):
    """y = x W^T with W = weight (e4m3) x weight_scale (fp32, per output row); no bias (the LLM has none)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        assert linear.bias is None, "the LLM's projections have no bias"
        w8, scale = quantize_weight(linear.weight.detach())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", w8)
        self.register_buffer("weight_scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale)

    def _apply(self, fn, recurse=True):
        # A module cast (model.to(bf16), the per-part casts of cast_for_inference) must move the weights, never
        # turn the e4m3 values into another dtype: apply fn for its device only.
        for name in ("weight", "weight_scale"):
            t = getattr(self, name)
            moved = fn(torch.empty(0, device=t.device, dtype=torch.float32))
            setattr(self, name, t.to(moved.device))
        return self


def quantize_llm_projections(llm: nn.Module) -> int:
    """Replace the LLM's FP8_PROJECTIONS nn.Linear modules with Fp8Linear in place; -> how many. Idempotent."""
    count = 0
    check_fp8_device(next(llm.parameters()).device)
    for parent in list(llm.modules()):
        for name, child in list(parent.named_children()):
            if name in FP8_PROJECTIONS and type(child) is nn.Linear:
                setattr(parent, name, Fp8Linear(child))
                count += 1
    return count
