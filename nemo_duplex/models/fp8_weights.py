"""Projections with float8 weights: `model.dtype.llm_weights` and `model.dtype.talker_weights`.

At load (VoiceChat.cast_for_inference) the chosen projections become `Fp8Linear`: the weight in e4m3 with a
scale per output row. Two products (WEIGHT_PRODUCTS, nemo_duplex/models/config.py):
- `fp8`: each call's rows of x quantised to e4m3 as they come, then Hopper's FP8 GEMM (ops/fp8_linear.py);
- `fp8_weight_only`: x stays in the part's bf16, each weight tile widened to bf16 in registers
  (ops/fp8_weight_linear.py): the weight's rounding only, one kernel per projection.
LLM_PROJECTIONS are the Mamba in_proj / out_proj and MLP up_proj / down_proj (~7 of the LLM's ~9 billion
parameters; the attention layers' q/k/v/o, the embedding and the heads stay in the LLM's dtype).
TALKER_PROJECTIONS are every projection of the talker backbone's 28 layers (~0.6 of its ~0.8 billion); the
stacked ones (q/k/v, gate/up) stack in e4m3 (nemo_duplex/models/stacking.py). The checkpoint is read as usual
first: this is a cast.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from nemo_duplex.models.config import WEIGHT_PRODUCTS
from ops import check_fp8_device
from ops.fp8_linear import fp8_linear, quantize_weight
from ops.fp8_weight_linear import fp8_weight_linear

LLM_PROJECTIONS = ("in_proj", "out_proj", "up_proj", "down_proj")
TALKER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_product(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, product: str) -> torch.Tensor:
    """x [..., K] times e4m3 weight rows w8 [N, K] with their scales [N] -> [..., N], by WEIGHT_PRODUCTS' `product`."""
    if product == "fp8":
        return fp8_linear(x, w8, w_scale)
    return fp8_weight_linear(x, w8, w_scale)


class Fp8Linear(nn.Module):
    """y = x W^T with W = weight (e4m3) x weight_scale (fp32, per output row), by `product` (WEIGHT_PRODUCTS); no
    bias (none of the projections has one)."""

    def __init__(self, linear: nn.Linear, product: str):
        super().__init__()
        assert linear.bias is None, "the quantised projections have no bias"
        assert product in WEIGHT_PRODUCTS, product
        w8, scale = quantize_weight(linear.weight.detach())
        self.in_features, self.out_features, self.product = linear.in_features, linear.out_features, product
        self.register_buffer("weight", w8)
        self.register_buffer("weight_scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_product(x, self.weight, self.weight_scale, self.product)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, product={self.product}"

    def _apply(self, fn, recurse=True):
        # A module cast (model.to(bf16), the per-part casts of cast_for_inference) must move the weights, never
        # turn the e4m3 values into another dtype: apply fn for its device only.
        for name in ("weight", "weight_scale"):
            t = getattr(self, name)
            moved = fn(torch.empty(0, device=t.device, dtype=torch.float32))
            setattr(self, name, t.to(moved.device))
        return self


def quantize_projections(root: nn.Module, names: tuple[str, ...], product: str, setting: str) -> int:
    """Replace every nn.Linear under root whose attribute name is in `names` with an Fp8Linear of `product`, in
    place; -> how many. Idempotent. `setting` names the switch in the error a GPU without float8 gives."""
    check_fp8_device(next(root.parameters()).device, setting)
    count = 0
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if name in names and type(child) is nn.Linear:
                setattr(parent, name, Fp8Linear(child, product))
                count += 1
    return count
