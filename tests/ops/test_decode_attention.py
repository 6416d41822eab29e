"""Decode attention kernel vs its torch reference (TRITON_INTERPRET=1 on CPU), plus full-shape GPU tests."""
import math

import pytest
import torch

from ops.decode_attention import (
    _rows_aligned,
    decode_attention,
    decode_attention_reference,
    decode_attention_triton,
    pick_num_splits,
)
from tests.ops.support import DEVICE

# the kernel runs on the GPU where there is one, else under TRITON_INTERPRET=1 (tests/conftest.py)


def _make(batch, num_heads, kv_heads, head_dim, max_len, num_slots, dtype, device, gen):
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(num_slots, kv_heads, max_len, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(num_slots, kv_heads, max_len, head_dim, generator=gen).to(device, dtype)
    return q, k, v


def _naive(q, k_cache, v_cache, slots, seq_lens, scale, window):
    """Per-row, per-head loop: the most literal statement of the semantics."""
    batch, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        n = int(seq_lens[b])
        lo = 0 if window is None else max(0, n - window)  # pos > (n - 1) - window
        for h in range(num_heads):
            k = k_cache[int(slots[b]), h // group, lo:n].double()
            v = v_cache[int(slots[b]), h // group, lo:n].double()
            p = torch.softmax(k @ q[b, h].double() * scale, dim=0)
            out[b, h] = p @ v
    return out


# (num_heads, kv_heads, head_dim, window, num_splits)
CASES = [
    (4, 4, 18, None, 1),     # talker-like: ratio 1, head dim not a power of two
    (4, 4, 18, 7, 1),        # sliding window
    (4, 2, 24, None, 1),     # LLM-like: GQA ratio 2
    (10, 2, 24, None, 3),    # GQA ratio 5, split over the sequence
    (4, 4, 18, 5, 4),        # window with splits (some splits entirely outside the window)
    (6, 3, 16, None, 2),
    (3, 3, 20, None, 2),     # vector kernel: head dim 16 + a tail of 4
    (3, 3, 28, 9, 3),        # vector kernel: tail of 12 read through a masked 16-wide block
    (2, 2, 16, None, 1),     # vector kernel: power-of-two head dim, no tail
]


@pytest.mark.parametrize("num_heads,kv_heads,head_dim,window,num_splits", CASES)
def test_kernel_matches_reference(num_heads, kv_heads, head_dim, window, num_splits):
    gen = torch.Generator().manual_seed(num_heads * 100 + head_dim + (window or 0) + num_splits)
    max_len, num_slots = 40, 6
    q, k, v = _make(5, num_heads, kv_heads, head_dim, max_len, num_slots, torch.float32, DEVICE, gen)
    # rows at different lengths; two padding rows on the sink slot (last row of the pool)
    slots = torch.tensor([2, 0, 4, 5, 5], dtype=torch.int64, device=DEVICE)
    seq_lens = torch.tensor([1, 17, 40, 1, 3], dtype=torch.int64, device=DEVICE)
    scale = 1.0 / math.sqrt(head_dim)
    ref = decode_attention_reference(q, k, v, slots, seq_lens, scale, window)
    naive = _naive(*(t.cpu() for t in (q, k, v, slots, seq_lens)), scale, window).to(DEVICE)
    out = decode_attention_triton(q, k, v, slots, seq_lens, scale, window, num_splits=num_splits)
    # tolerances: fp32 everywhere, different summation orders only
    torch.testing.assert_close(ref.double(), naive, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_vector_kernel_small_key_blocks(num_splits):
    """8 keys per block (an override the attention sweep of scripts/dev/bench_ops.py times) over rows whose
    lengths are not multiples of 8, head dim 72 (64 + a tail of 8), with a sliding window."""
    gen = torch.Generator().manual_seed(num_splits)
    q, k, v = _make(4, 2, 2, 72, 45, 5, torch.float32, DEVICE, gen)
    slots = torch.tensor([3, 0, 4, 1], dtype=torch.int64, device=DEVICE)
    seq_lens = torch.tensor([1, 9, 45, 30], dtype=torch.int64, device=DEVICE)
    ref = decode_attention_reference(q, k, v, slots, seq_lens, 0.2, 20)
    out = decode_attention_triton(q, k, v, slots, seq_lens, 0.2, 20, num_splits=num_splits, block_n=8)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # fp32: summation order only


@pytest.mark.parametrize("kv_heads", [3, 1])
def test_splits_follow_each_rows_length(kv_heads):
    """A pool far longer than the rows (max_len 300, rows 1..45 keys long): the splits cut each row's own
    keys, so every split count gives the same answer, including splits left without keys."""
    gen = torch.Generator().manual_seed(11 + kv_heads)
    q, k, v = _make(4, 3, kv_heads, 20, 300, 5, torch.float32, DEVICE, gen)
    slots = torch.tensor([4, 0, 2, 1], device=DEVICE)
    seq_lens = torch.tensor([45, 1, 17, 33], device=DEVICE)
    ref = decode_attention_reference(q, k, v, slots, seq_lens, 0.3, window=20)
    for num_splits in (1, 2, 5, 8):  # 8 splits of a 1-key row: 7 are empty
        out = decode_attention_triton(q, k, v, slots, seq_lens, 0.3, window=20, num_splits=num_splits,
                                      block_n=16)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # fp32, summation order only


def test_pick_num_splits_fills_the_gpu_only_when_needed():
    # talker (vector kernel, 1 warp per program): N=128 -> 4096 programs, N=32 -> 1024, N=1 -> 32
    assert pick_num_splits(programs=4096, max_len=1101, block_n=16, num_sms=132, num_warps=1) == 1
    assert pick_num_splits(programs=4096, max_len=1101, block_n=16, num_sms=132, num_warps=1, min_splits=2) == 2
    assert pick_num_splits(programs=4096, max_len=20, block_n=16, num_sms=132, num_warps=1, min_splits=2) == 1
    assert pick_num_splits(programs=1024, max_len=1101, block_n=16, num_sms=132, num_warps=1) == 2
    assert pick_num_splits(programs=32, max_len=1101, block_n=16, num_sms=132, num_warps=1) == 32
    # LLM (group kernel, 4 warps): N=1 -> 8 programs, capped by the pool length
    assert pick_num_splits(programs=8, max_len=1101, block_n=64, num_sms=132, num_warps=4) == 9
    assert pick_num_splits(programs=32, max_len=100, block_n=64, num_sms=132) == 1      # short pool
    assert pick_num_splits(programs=1, max_len=10 ** 6, block_n=64, num_sms=132) == 32  # capped


def test_rows_aligned_only_when_every_key_row_starts_on_8_elements():
    # the talker's served pool (37 prompt frames + 2000): odd max_len, 144-byte rows -> 16-byte loads are safe
    pool = torch.empty(3, 16, 2037, 72, dtype=torch.bfloat16)
    assert _rows_aligned(pool)
    assert not _rows_aligned(torch.empty(3, 4, 20, 36, dtype=torch.bfloat16))  # 72-byte rows
    shifted = torch.empty(pool.numel() + 1, dtype=torch.bfloat16)[1:].view(pool.shape)  # base 2 bytes off
    assert not _rows_aligned(shifted)
    assert _rows_aligned(torch.empty(3, 16, 2037, 72, dtype=torch.float8_e4m3fn))  # 8 elements = 8 bytes


def test_bf16_cache():
    gen = torch.Generator().manual_seed(5)
    q, k, v = _make(3, 10, 2, 24, 24, 4, torch.bfloat16, DEVICE, gen)
    slots, seq_lens = torch.tensor([3, 1, 0], device=DEVICE), torch.tensor([24, 2, 13], device=DEVICE)
    for num_splits in (1, 2):
        out = decode_attention_triton(q, k, v, slots, seq_lens, 0.2, window=9, num_splits=num_splits)
        ref = decode_attention_reference(q, k, v, slots, seq_lens, 0.2, window=9)
        assert out.dtype == torch.bfloat16
        # both compute in fp32 from the same bf16 inputs; the output rounding to bf16 dominates
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_garbage_past_length_is_ignored():
    """Positions at or past seq_len (stale data of an earlier call, even NaN/inf) must not leak in."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = _make(2, 4, 2, 24, 32, 3, torch.float32, DEVICE, gen)
    slots = torch.tensor([0, 1], device=DEVICE)
    seq_lens = torch.tensor([5, 9], device=DEVICE)
    clean = decode_attention_triton(q, k, v, slots, seq_lens, 0.2, num_splits=2)
    k[:, :, 9:] = float("nan")
    v[:, :, 9:] = float("inf")
    k[0, :, 5:] = float("nan")
    v[0, :, 5:] = float("nan")
    for out in (decode_attention_triton(q, k, v, slots, seq_lens, 0.2, num_splits=2),
                decode_attention_reference(q, k, v, slots, seq_lens, 0.2)):
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, clean, rtol=1e-5, atol=1e-5)


def test_launcher_uses_kernel_under_interpreter():
    # conftest sets TRITON_INTERPRET=1 on CPU machines: the launcher must then run the kernel
    gen = torch.Generator().manual_seed(3)
    q, k, v = _make(2, 4, 4, 18, 16, 3, torch.float32, DEVICE, gen)
    slots, seq_lens = torch.tensor([0, 2], device=DEVICE), torch.tensor([16, 4], device=DEVICE)
    out = decode_attention(q, k, v, slots, seq_lens, 1.0 / 16, window=6)
    torch.testing.assert_close(out, decode_attention_reference(q, k, v, slots, seq_lens, 1.0 / 16, 6),
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------- GPU (full shapes)

GPU_CASES = [
    # LLM: 40 q / 8 kv heads x 128, NoPE scale 1/sqrt(128), no window (spec 3.4)
    (40, 8, 128, 1.0 / math.sqrt(128), None),
    # talker: 16 x 72 heads, query scale 1/16, sliding window 7500 and full layers (spec 4.1)
    (16, 16, 72, 1.0 / 16, 7500),
    (16, 16, 72, 1.0 / 16, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 7, 128])
@pytest.mark.parametrize("num_heads,kv_heads,head_dim,scale,window", GPU_CASES)
def test_gpu_full_shapes(num_heads, kv_heads, head_dim, scale, window, batch, dtype):
    gen = torch.Generator().manual_seed(batch)
    max_len, num_slots = 8192, batch + 1
    q, k, v = _make(batch, num_heads, kv_heads, head_dim, max_len, num_slots, dtype, "cuda", gen)
    slots = torch.randperm(num_slots, generator=gen)[:batch].cuda()
    seq_lens = torch.randint(1, max_len + 1, (batch,), generator=gen).cuda()
    seq_lens[0] = max_len
    out = decode_attention(q, k, v, slots, seq_lens, scale, window)
    ref = decode_attention_reference(q, k, v, slots, seq_lens, scale, window)
    # fp32: ieee dots, only summation order differs; bf16: p is rounded to bf16 before P.V
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,kv_heads,head_dim", [(16, 16, 72), (40, 8, 128)])
def test_gpu_loop_forms_and_tunings_agree(num_heads, kv_heads, head_dim):
    """The compiled kernel's counted (pipelined) loop, the interpreter's while loop, and other block sizes /
    warps / split counts all give the fp32 reference's answer (bf16 cache, rows at different lengths)."""
    gen = torch.Generator().manual_seed(head_dim)
    batch, max_len = 9, 3001  # odd, like the served talker pool (37 + 2000): per-head bases not 32-byte aligned
    q, k, v = _make(batch, num_heads, kv_heads, head_dim, max_len, batch + 1, torch.bfloat16, "cuda", gen)
    slots = torch.randperm(batch + 1, generator=gen)[:batch].cuda()
    seq_lens = torch.tensor([1, 2, 63, 64, 65, 1037, 2047, 2999, 3000], device="cuda")
    ref = decode_attention_reference(q, k, v, slots, seq_lens, 0.1, window=1500)
    for kw in (dict(pipelined=True), dict(pipelined=False), dict(block_n=32, num_warps=2, num_splits=3),
               dict(block_n=128 if kv_heads == num_heads else 32, num_warps=8, num_splits=1),
               dict(block_n=8 if kv_heads == num_heads else 16, num_splits=1)):
        out = decode_attention_triton(q, k, v, slots, seq_lens, 0.1, window=1500, **kw)
        # both read the same bf16 values and compute in fp32; the output's bf16 rounding dominates
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2, msg=str(kw))


@pytest.mark.parametrize("num_heads,kv_heads,head_dim,window,num_splits,page_len", [
    (4, 4, 18, None, 1, 8),   # the vector kernel, blocks of 16 keys over pages of 8
    (3, 3, 72, 13, 3, 16),    # the talker's head dim, a window whose start is not page aligned, splits
    (10, 2, 24, None, 3, 32),  # GQA (the group kernel), pages of 32, blocks of 64
    (4, 2, 24, 9, 2, 16),     # GQA with a window (tl.dot takes blocks of 16 or more: pages of 16 at least)
])
def test_paged_pool_gives_the_unpaged_answer(num_heads, kv_heads, head_dim, window, num_splits, page_len):
    """The same keys in shuffled pages (ops/kv_pages.py) with a page table: the kernel gives bit for bit what
    it gives on the unpaged pool with the same key blocks (the launcher keeps a block within a page), the
    reference agrees with it, and the rows read only their own pages (the noise pages beside them never
    enter: any would move the answer)."""
    from tests.ops.support import paginate
    gen = torch.Generator().manual_seed(num_heads + head_dim + page_len)
    q, k, v = _make(5, num_heads, kv_heads, head_dim, 40, 6, torch.float32, DEVICE, gen)
    slots = torch.tensor([2, 0, 4, 5, 5], dtype=torch.int64, device=DEVICE)
    seq_lens = torch.tensor([1, 17, 40, 1, 3], dtype=torch.int64, device=DEVICE)
    (k_paged, v_paged), pages = paginate((k, v), page_len, gen)
    scale = 1.0 / math.sqrt(head_dim)
    block_n = min(page_len, 16 if kv_heads == num_heads else 64)   # what the launcher takes for these pages
    flat = decode_attention_triton(q, k, v, slots, seq_lens, scale, window, num_splits=num_splits, block_n=block_n)
    paged = decode_attention_triton(q, k_paged, v_paged, slots, seq_lens, scale, window, num_splits=num_splits,
                                    pages=pages)
    ref = decode_attention_reference(q, k_paged, v_paged, slots, seq_lens, scale, window, pages=pages)
    assert torch.equal(paged, flat)
    torch.testing.assert_close(ref, decode_attention_reference(q, k, v, slots, seq_lens, scale, window),
                               rtol=0, atol=0)   # the reference gathers the same values in the same order
    torch.testing.assert_close(paged, ref, rtol=1e-5, atol=1e-5)  # fp32, summation order only


@pytest.mark.parametrize("num_heads,kv_heads,head_dim,window,page_len", [
    (3, 3, 72, None, None),   # the talker's head dim, unpaged
    (3, 3, 72, 13, 16),       # paged, a window
    (4, 2, 24, None, 16),     # the group kernel reads fp8 pools too
])
def test_fp8_pool_gives_the_answer_of_its_values(num_heads, kv_heads, head_dim, window, page_len):
    """`dtype.talker_kv: fp8`: the kernel upcasts float8 e4m3 keys and values as they are loaded, so an fp8
    pool gives bit for bit what a bf16 pool holding the same values gives (e4m3 values are exact in bf16),
    and the reference, which upcasts the same stored values, agrees within the bf16 output's rounding."""
    from ops.kv_pages import to_pool
    from tests.ops.support import paginate
    gen = torch.Generator().manual_seed(head_dim + (window or 0))
    q, k, v = _make(5, num_heads, kv_heads, head_dim, 40, 6, torch.bfloat16, DEVICE, gen)
    k8, v8 = to_pool(k * 3, torch.float8_e4m3fn), to_pool(v * 3, torch.float8_e4m3fn)
    pages = None
    if page_len is not None:
        (k8, v8), pages = paginate((k8, v8), page_len, gen)
    k16, v16 = k8.to(torch.bfloat16), v8.to(torch.bfloat16)
    slots = torch.tensor([2, 0, 4, 5, 5], dtype=torch.int64, device=DEVICE)
    seq_lens = torch.tensor([1, 17, 40, 2, 33], dtype=torch.int64, device=DEVICE)
    scale = 1.0 / math.sqrt(head_dim)
    narrow = decode_attention_triton(q, k8, v8, slots, seq_lens, scale, window, num_splits=2, pages=pages)
    wide = decode_attention_triton(q, k16, v16, slots, seq_lens, scale, window, num_splits=2, pages=pages)
    ref = decode_attention_reference(q, k8, v8, slots, seq_lens, scale, window, pages=pages)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow, wide)
    torch.testing.assert_close(narrow.float(), ref.float(), rtol=1e-2, atol=1e-2)
