"""kv_write, the custom op that writes keys and values into a pool (tests/test_compiled_writes.py says why it
is an op): each (row, position) lands where kv_places says, written out here position by position, paged
and unpaged, into one layer of a stacked pool (a view), and saturated for a float8 pool; torch.library's
opcheck checks its schema (the pool declared mutated) and its fake implementation. Exact: a copy."""
import pytest
import torch

from ops.kv_pages import FP8_MAX, kv_write, kv_write_op
from tests.ops.support import DEVICE, OPCHECK_TESTS

LAYERS, ROWS, KV, PAGE_LEN, D = 3, 4, 2, 4, 8


def _case(gen, paged: bool, dtype=torch.float32):
    """(stacked pool, page table or None, rows [B, T], positions [B, T], values [B, T, KV, D])."""
    if paged:   # 3 pages of 4 positions per row, in shuffled order, plus a sink page never handed out
        pool = torch.zeros(LAYERS, ROWS * 3 + 1, KV, PAGE_LEN, D, dtype=dtype, device=DEVICE)
        pages = torch.randperm(ROWS * 3, generator=gen).view(ROWS, 3).to(DEVICE, torch.int32)
    else:
        pool = torch.zeros(LAYERS, ROWS, KV, 3 * PAGE_LEN, D, dtype=dtype, device=DEVICE)
        pages = None
    rows = torch.tensor([[2], [0], [3]], device=DEVICE)
    positions = torch.tensor([[0, 5, 6], [11, 3, 4], [7, 8, 1]], device=DEVICE)
    values = 3 * torch.randn(3, 3, KV, D, generator=gen).to(DEVICE)
    return pool, pages, rows.expand(3, 3), positions, values


def _written_out(pool, pages, rows, positions, values):
    expected = pool.clone()
    for b in range(rows.shape[0]):
        for t in range(rows.shape[1]):
            r, p = int(rows[b, t]), int(positions[b, t])
            row, offset = (r, p) if pages is None else (int(pages[r, p // PAGE_LEN]), p % PAGE_LEN)
            expected[row, :, offset] = values[b, t].float().clamp(-FP8_MAX, FP8_MAX).to(pool.dtype)
    return expected


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_writes_each_position_into_one_layer(paged, dtype):
    gen = torch.Generator().manual_seed(int(paged) * 10 + len(str(dtype)))
    pool, pages, rows, positions, values = _case(gen, paged, dtype)
    if dtype == torch.float8_e4m3fn:
        values[0, 0, 0, 0] = 1000.0   # past e4m3's range: saturated, not inf or nan
    before = pool.clone()
    expected = _written_out(pool[1], pages, rows, positions, values)
    kv_write(pool[1], pages, rows, positions, values)
    assert torch.equal(pool[1].float(), expected.float())
    assert torch.equal(pool[0].float(), before[0].float()) and torch.equal(pool[2].float(), before[2].float())
    if dtype == torch.float8_e4m3fn:
        assert pool.float().abs().max() == FP8_MAX


@pytest.mark.parametrize("paged", [False, True])
def test_opcheck(paged):
    gen = torch.Generator().manual_seed(3)
    pool, pages, rows, positions, values = _case(gen, paged)
    torch.library.opcheck(kv_write_op, (pool[1], pages, rows, positions, values), test_utils=OPCHECK_TESTS)
