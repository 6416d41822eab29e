"""Linears that share one weight tensor: one GEMM computes them all, with no second copy of the weights.

Used where several projections read the same input: the talker's attention q/k/v and gated-MLP gate/up,
the encoder's attention q/k/v. Each Linear's weight becomes a row block of the stack, so the official
checkpoint keys still load (into the blocks), and a state_dict load updates the stack in place. Float8
projections (Fp8Linear, nemo_duplex/models/fp8_weights.py) stack alike: their e4m3 rows and their row scales.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nemo_duplex.models.fp8_weights import Fp8Linear, fp8_product


def stack_blocks(modules, name: str, wrap=lambda block, old: block) -> torch.Tensor:
    """The modules' tensors `name` as row blocks of ONE tensor, each module's re-pointed at its block
    (`wrap(block, old tensor)` makes what is assigned: a Parameter for a weight, the block for a buffer)."""
    stack = torch.cat([getattr(m, name) for m in modules])
    row = 0
    for m in modules:
        old = getattr(m, name)
        setattr(m, name, wrap(stack[row: row + old.shape[0]], old))
        row += old.shape[0]
    return stack


@torch.no_grad()
def stack_linears(*linears: nn.Linear) -> torch.Tensor:
    """The linears' weights as row blocks of ONE tensor [sum of outs, in], each Linear's weight re-pointed
    at its block: one GEMM then computes all of them (fewer launches per step: the talker runs ~2,000
    small kernels a frame), with no second copy of the weights; loading a state_dict writes into the
    blocks. A cast or move (Module._apply) would give each weight a tensor of its own, so the modules
    that stack re-stack after one (`StackedProjections`)."""
    return stack_blocks(linears, "weight", lambda block, old: nn.Parameter(block, requires_grad=old.requires_grad))


@torch.no_grad()
def stack_fp8_linears(*linears: Fp8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """stack_linears for Fp8Linear: (e4m3 rows [sum of outs, in], their scales [sum of outs]), each module's
    weight and weight_scale re-pointed at its blocks (a row's scale belongs to the row, so stacking changes no
    value)."""
    return stack_blocks(linears, "weight"), stack_blocks(linears, "weight_scale")


class StackedProjections(nn.Module):
    """A module whose `stacked` linears (names of child Linears) may share one weight tensor, `stack`
    (None until `stack_projections`), re-stacked after every cast or move so it never holds stale values."""
    stacked: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self.stack: torch.Tensor | None = None
        self.stack_scale: torch.Tensor | None = None   # the row scales where the stacked linears are Fp8Linear
        self.stack_product: str | None = None

    def stack_projections(self) -> None:
        linears = [getattr(self, name) for name in self.stacked]
        fp8 = [isinstance(linear, Fp8Linear) for linear in linears]
        if all(fp8):
            if len({linear.product for linear in linears}) != 1:
                raise ValueError(f"{type(self).__name__}: stacked Fp8Linear with different products")
            self.stack, self.stack_scale = stack_fp8_linears(*linears)
            self.stack_product = linears[0].product
        elif any(fp8):
            raise ValueError(f"{type(self).__name__}: {self.stacked} are partly Fp8Linear; stack all or none")
        else:
            self.stack, self.stack_scale, self.stack_product = stack_linears(*linears), None, None

    def stacked_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., sum of outs]: every stacked linear in one GEMM."""
        if self.stack_scale is None:
            return F.linear(x, self.stack)
        return fp8_product(x, self.stack, self.stack_scale, self.stack_product)

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        if self.stack is not None:
            self.stack_projections()
        return out


def stack_all(root: nn.Module) -> None:
    """Stack every `StackedProjections` under root (itself included). Call it once the weights are on their
    device in their dtype: a cast before it would give each weight its own copy again."""
    for module in root.modules():
        if isinstance(module, StackedProjections):
            module.stack_projections()
