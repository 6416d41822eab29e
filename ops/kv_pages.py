"""KV pools in pages: where a row's key at a position lives, in plain torch.

A paged pool is `[num_pages, kv_heads, page_len, D]` with a page table `pages [R, max_pages]` (int32): row
r's position p lives at `pool[pages[r, p // page_len], :, p % page_len]`. A table entry a row has not been
given points at a sink page, so every address stays inside the pool (nemo_duplex/serving/pages.py hands
pages out). With `pages=None` the pool is the unpaged `[R, kv_heads, max_len, D]` and row r is pool row r:
the same functions serve both, and the kernels (ops/decode_attention.py, ops/rmsnorm.py's store) read the
same addresses these do.

A pool may hold float8 e4m3 (`model.dtype.talker_kv: fp8`): a value is stored as the nearest e4m3 value,
saturated at +-448 (clamped first, so that no path depends on what a cast makes of a value past the
range), unscaled: keys are RMS-normed per head and values stay far below 448 in practice, and e4m3's 3
mantissa bits keep a relative error of at most 1/16 over [2^-6, 448] without a scale to store and apply.
The kernels store and upcast the same values.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0   # float8_e4m3fn's largest finite value


def to_pool(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values as a pool of `dtype` stores them: a plain cast, saturated for float8 e4m3."""
    if dtype == torch.float8_e4m3fn:
        values = values.float().clamp(-FP8_MAX, FP8_MAX)
    return values.to(dtype)


def kv_places(pages: torch.Tensor | None, page_len: int, rows: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool row, offset) of each (row, position), rows and positions broadcast together: paged, the page the
    row's table names and the offset in it; unpaged (pages None), the row itself and the position. An index
    pair for pool[..., row, :, offset], over every layer of a stacked pool at once."""
    if pages is None:
        return torch.broadcast_tensors(rows, positions)
    page = pages[rows, torch.div(positions, page_len, rounding_mode="floor")].to(torch.int64)
    return page, positions % page_len


# A custom op so that a compiled step writes the pool in place. Written in torch, the write into one layer
# of a stacked pool (`pool = cache.k[layer]`) traces to a functional index_put on the layer and a
# select_scatter of the whole stack, which Inductor's reinplacing does not turn back into a write in place:
# every compiled step then rebuilt every layer's pool whole (tests/test_compiled_writes.py). A custom op
# that declares the pool mutated is one node that Inductor reinplaces on a view as on a whole pool.
@torch.library.custom_op("nemo_duplex::kv_write", mutates_args=("pool",))
def kv_write_op(pool: torch.Tensor, pages: torch.Tensor | None, rows: torch.Tensor, positions: torch.Tensor,
                values: torch.Tensor) -> None:
    row, offset = kv_places(pages, pool.shape[2], rows, positions)
    pool[row, :, offset] = to_pool(values, pool.dtype)


@kv_write_op.register_fake
def _(pool, pages, rows, positions, values):
    return None


def kv_write(pool: torch.Tensor, pages: torch.Tensor | None, rows: torch.Tensor, positions: torch.Tensor,
             values: torch.Tensor) -> None:
    """pool[row, :, position] = values for every (row, position): rows and positions broadcast to the
    leading shape of values [..., kv_heads, D]."""
    kv_write_op(pool, pages, rows, positions, values)


def kv_gather(pool: torch.Tensor, pages: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """Each row's keys by position: [len(rows), kv_heads, max_len, D] (max_len = max_pages x page_len paged)."""
    if pages is None:
        return pool[rows]
    blocks = pool[pages[rows].to(torch.int64)]          # [b, max_pages, kv, page_len, D]
    b, n, kv, page_len, d = blocks.shape
    return blocks.permute(0, 2, 1, 3, 4).reshape(b, kv, n * page_len, d)


def kv_max_len(pool: torch.Tensor, pages: torch.Tensor | None) -> int:
    """The positions a row can hold."""
    return pool.shape[2] if pages is None else pages.shape[1] * pool.shape[2]
