"""One symbol step of the streaming RNN-T's greedy decode, after the joint (spec 2.10): pick, emit, commit.

    k      = argmax(logits)                 (the first index of the maximum, as torch.argmax)
    emit   = active & (k != blank)
    tokens[:, column] = emit ? k : -1
    h, c   = emit ? (h_next, c_next) : (h, c)   per row, every LSTM layer
    last   = emit ? k : last
    active = emit

Why a kernel: in torch these are eight launches per symbol step (argmax, !=, &, where and the column copy,
three more wheres) and the decode runs its ten symbol steps on every frame (the op sequence must not depend
on the data inside a captured graph): ~80 of the RNN-T's ~260 launches per frame step
(scripts/dev/census_step.py). Selections and an exact maximum only: bit for bit the torch statements.
h, c, last, active and tokens are updated in place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import use_triton

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def rnnt_commit_reference(logits: torch.Tensor, blank: int, active: torch.Tensor, h_next: torch.Tensor,
                          h: torch.Tensor, c_next: torch.Tensor, c: torch.Tensor, last: torch.Tensor,
                          tokens: torch.Tensor, column: int) -> None:
    """logits [B, V]; active [B] bool; h_next, h, c_next, c [layers, B, H]; last [B] int64; tokens [B, S]."""
    k = logits.argmax(-1)
    emit = active & (k != blank)
    tokens[:, column] = torch.where(emit, k, -1)
    h.copy_(torch.where(emit[None, :, None], h_next, h))
    c.copy_(torch.where(emit[None, :, None], c_next, c))
    last.copy_(torch.where(emit, k, last))
    active.copy_(emit)


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _rnnt_commit_kernel(logits_ptr, active_ptr, hn_ptr, h_ptr, cn_ptr, c_ptr, last_ptr, tokens_ptr,
                        V, H, blank, column, stride_logits, stride_tokens,
                        stride_hnl, stride_hnb, stride_hl, stride_hb, stride_cnl, stride_cnb, stride_cl, stride_cb,
                        LAYERS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    """One row per program."""
    row = tl.program_id(0).to(tl.int64)
    vs = tl.arange(0, BLOCK_V)
    logits = tl.load(logits_ptr + row * stride_logits + vs, mask=vs < V, other=float("-inf")).to(tl.float32)
    k = tl.argmax(logits, axis=0, tie_break_left=True).to(tl.int64)
    emit = (tl.load(active_ptr + row) != 0) & (k != blank)
    tl.store(tokens_ptr + row * stride_tokens + column, tl.where(emit, k, -1))
    tl.store(last_ptr + row, tl.where(emit, k, tl.load(last_ptr + row)))
    tl.store(active_ptr + row, emit.to(active_ptr.dtype.element_ty))
    hs = tl.arange(0, BLOCK_H)
    # the row's emit as a per-lane comparison, so the mask is boolean (Triton 3.9's interpreter takes a
    # scalar-and-vector & as int32, which a load mask cannot be)
    h_mask = (hs < H) & ((hs * 0 + emit.to(tl.int32)) != 0)
    for layer in tl.static_range(LAYERS):
        hn = tl.load(hn_ptr + layer * stride_hnl + row * stride_hnb + hs, mask=h_mask)
        tl.store(h_ptr + layer * stride_hl + row * stride_hb + hs, hn, mask=h_mask)
        cn = tl.load(cn_ptr + layer * stride_cnl + row * stride_cnb + hs, mask=h_mask)
        tl.store(c_ptr + layer * stride_cl + row * stride_cb + hs, cn, mask=h_mask)


def rnnt_commit_triton(logits: torch.Tensor, blank: int, active: torch.Tensor, h_next: torch.Tensor,
                       h: torch.Tensor, c_next: torch.Tensor, c: torch.Tensor, last: torch.Tensor,
                       tokens: torch.Tensor, column: int) -> None:
    layers, batch, hidden = h.shape
    assert h_next.shape == h.shape == c.shape == c_next.shape and h_next.dtype == h.dtype and c_next.dtype == c.dtype
    assert active.dtype == torch.bool and last.dtype == tokens.dtype == torch.int64
    assert all(t.stride(-1) == 1 for t in (logits, h_next, h, c_next, c)) and tokens.stride(1) == 1
    if batch == 0:
        return
    vocab = logits.shape[1]
    _rnnt_commit_kernel[(batch,)](
        logits, active, h_next, h, c_next, c, last, tokens, vocab, hidden, blank, column,
        logits.stride(0), tokens.stride(0),
        h_next.stride(0), h_next.stride(1), h.stride(0), h.stride(1),
        c_next.stride(0), c_next.stride(1), c.stride(0), c.stride(1),
        LAYERS=layers, BLOCK_V=triton.next_power_of_2(vocab), BLOCK_H=triton.next_power_of_2(hidden), num_warps=4,
    )


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py); its in-place updates are declared.
@torch.library.custom_op("nemo_duplex::rnnt_commit", mutates_args=("active", "h", "c", "last", "tokens"))
def rnnt_commit_op(logits: torch.Tensor, blank: int, active: torch.Tensor, h_next: torch.Tensor, h: torch.Tensor,
                   c_next: torch.Tensor, c: torch.Tensor, last: torch.Tensor, tokens: torch.Tensor,
                   column: int) -> None:
    rnnt_commit_triton(logits, blank, active, h_next, h, c_next, c, last, tokens, column)


@rnnt_commit_op.register_fake
def _(logits, blank, active, h_next, h, c_next, c, last, tokens, column):
    return None


def rnnt_commit(logits: torch.Tensor, blank: int, active: torch.Tensor, h_next: torch.Tensor, h: torch.Tensor,
                c_next: torch.Tensor, c: torch.Tensor, last: torch.Tensor, tokens: torch.Tensor, column: int) -> None:
    """See the module docstring; in place. One kernel on CUDA or under TRITON_INTERPRET=1, else torch."""
    if use_triton(logits):
        rnnt_commit_op(logits, int(blank), active, h_next, h, c_next, c, last, tokens, int(column))
    else:
        rnnt_commit_reference(logits, blank, active, h_next, h, c_next, c, last, tokens, column)
