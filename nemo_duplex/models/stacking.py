"""Linears that share one weight tensor: one GEMM computes them all, with no second copy of the weights.

Used where several projections read the same input: the talker's attention q/k/v and gated-MLP gate/up,
the encoder's attention q/k/v. Each Linear's weight becomes a row block of the stack, so the official
checkpoint keys still load (into the blocks), and a state_dict load updates the stack in place.
"""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def stack_linears(*linears: nn.Linear) -> torch.Tensor:
    """The linears' weights as row blocks of ONE tensor [sum of outs, in], each Linear's weight re-pointed
    at its block: one GEMM then computes all of them (fewer launches per step: the talker runs ~2,000
    small kernels a frame), with no second copy of the weights; loading a state_dict writes into the
    blocks. A cast or move (Module._apply) would give each weight a tensor of its own, so the modules
    that stack re-stack after one (`StackedProjections`)."""
    stack = torch.cat([linear.weight for linear in linears])
    row = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(stack[row: row + rows], requires_grad=linear.weight.requires_grad)
        row += rows
    return stack


class StackedProjections(nn.Module):
    """A module whose `stacked` linears (names of child Linears) may share one weight tensor, `stack`
    (None until `stack_projections`), re-stacked after every cast or move so it never holds stale values."""
    stacked: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self.stack: torch.Tensor | None = None

    def stack_projections(self) -> None:
        self.stack = stack_linears(*(getattr(self, name) for name in self.stacked))

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
