"""The weight bytes one frame step reads: what the memory floor of a step counts ("weight bytes read per
step"), measured on the step itself rather than assumed from the parameter list.

A step does not read every parameter and buffer: the LLM's 131072-row embedding table and the talker's
per-token table are gathered a row per call, the codec's encoder and the talker's prompt projection run
only at admission, the char-aware subword encoder only builds the per-token table, and on CUDA the codec's
GEMMs read their fp16 splits instead of the fp32 weights. Counting the parameter list overstates the floor
by those bytes.

How: one eager frame step under a TorchDispatchMode that sees every op with its tensor arguments (every
Triton kernel of ops/ is a torch.library custom op, so it is seen too, with the weights it is given). An
argument that is a view of a model tensor reads that view's extent of the storage (an op that makes a
view or an empty tensor like it reads nothing); extents are merged per storage, so a weight read by
several ops (or in several MoG passes) counts once, as a step that kept it in cache would read it. A
gather from a table (embedding, index_select, index) reads the rows it returns, counted as the bytes it
returns (not merged: an upper bound where two rows repeat); so do the custom ops that gather rows of a
table inside their kernel (`_custom_gathers`: the code embedding's codebook sum, the MoG latent draw's
component blocks), which the counter would otherwise count as reading the whole table.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nemo_duplex.serving.frame_step import frame_step

aten = torch.ops.aten
# ops that read rows of their first argument, as many as they return
GATHERS = {aten.embedding.default, aten.index_select.default, aten.index.Tensor}
# ops that read no element of their arguments: views (besides those whose schema says so, `is_view`) and
# allocations shaped like an argument
NO_READS = {aten._unsafe_view.default, aten._reshape_alias.default, aten.empty_like.default,
            aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.new_empty.default,
            aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}


def _codebook_sum_rows(args) -> dict[int, int]:
    """codebook_sum(codes [..., Q], tables [Q, K, D], repeat): one row of a table per code (repeated output
    rows read the same rows again, from cache)."""
    codes, tables = args[0], args[1]
    return {id(tables): codes.numel() * tables.shape[-1] * tables.element_size()}


def _mog_latent_rows(args) -> dict[int, int]:
    """mog_latent(x [B, H], component, w_mus [P * R, H], low_mat [P, L, R], ...): per row, the drawn
    component's R x H block of w_mus and its L x R block of low_mat."""
    x, w_mus, low_mat = args[0], args[2], args[3]
    rank = low_mat.shape[2]
    return {id(w_mus): x.shape[0] * rank * w_mus.shape[1] * w_mus.element_size(),
            id(low_mat): x.shape[0] * low_mat.shape[1] * rank * low_mat.element_size()}


def _custom_gathers() -> dict:
    """Custom ops (ops/) whose kernels gather rows of some arguments: op -> (args -> {id(arg): bytes})."""
    import ops.codebook_sum  # noqa: F401  (registers the ops)
    import ops.mog_latent  # noqa: F401
    return {torch.ops.nemo_duplex.codebook_sum.default: _codebook_sum_rows,
            torch.ops.nemo_duplex.mog_latent.default: _mog_latent_rows}


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, end) of the storage that a strided view spans."""
    start = t.storage_offset()
    last = start + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return start * t.element_size(), (last + 1) * t.element_size()


def _merged_bytes(spans: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclass
class WeightReads:
    """Bytes read per model tensor (by its first name) in the counted ops: whole views, merged; gathered
    rows, summed."""
    spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    gathered: dict[str, int] = field(default_factory=dict)

    def by_tensor(self) -> dict[str, int]:
        out = {name: _merged_bytes(s) for name, s in self.spans.items()}
        for name, n in self.gathered.items():
            out[name] = out.get(name, 0) + n
        return out

    @property
    def total(self) -> int:
        return sum(self.by_tensor().values())


class CountWeightReads(TorchDispatchMode):
    """`with CountWeightReads(model) as counter: <eager ops>`; then `counter.reads`."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.names: dict[int, str] = {}
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.numel():
                self.names.setdefault(t.untyped_storage().data_ptr(), name)
        self.reads = WeightReads()
        self.custom_gathers = _custom_gathers()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "is_view", False) or func in NO_READS:
            return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        rows = self.custom_gathers[func](args) if func in self.custom_gathers else {}
        for i, t in enumerate(tensors):
            if t.numel() == 0 or t.device.type == "meta":
                continue
            name = self.names.get(t.untyped_storage().data_ptr())
            if name is None:
                continue
            if i == 0 and func in GATHERS:
                self.reads.gathered[name] = self.reads.gathered.get(name, 0) + out.numel() * out.element_size()
            elif id(t) in rows:
                self.reads.gathered[name] = self.reads.gathered.get(name, 0) + rows[id(t)]
            else:
                self.reads.spans.setdefault(name, []).append(_extent(t))
        return out


@torch.no_grad()
def step_weight_reads(model, st, specials: torch.Tensor, slots: torch.Tensor) -> WeightReads:
    """The weight reads of one eager greedy frame step of the calls in `slots`, after one step not counted:
    tables built on a first step (the encoder's stacked q/k/v, the codec's stacked codebooks) exist by
    then. Both steps advance the calls' state like any step (the caller refills it if that matters)."""
    n = slots.shape[0]
    device = slots.device
    audio = torch.randn(n, model.cfg.samples_per_frame_in, device=device) * 0.1
    forced = torch.full((n,), -1, dtype=torch.int64, device=device)
    frame_step(model, st, slots, audio, forced, specials, sampling=False)
    with CountWeightReads(model) as counter:
        frame_step(model, st, slots, audio, forced, specials, sampling=False)
    return counter.reads


def fixed_and_per_call(model, st, specials: torch.Tensor, device) -> tuple[int, int, WeightReads]:
    """(bytes every step reads whatever N, bytes more per call, the reads at one call): from steps of one
    and two calls (the gathered rows grow with N; the whole-tensor reads do not)."""
    one = step_weight_reads(model, st, specials, torch.arange(1, dtype=torch.int64, device=device))
    two = step_weight_reads(model, st, specials, torch.arange(2, dtype=torch.int64, device=device))
    per_call = two.total - one.total
    return one.total - per_call, per_call, one
