"""ops/bounded_attention.py: the Triton kernel (TRITON_INTERPRET=1 on CPU) against the torch reference,
and the reference + ring layout against the plain definition of spec 2.4/2.6 for one query."""
import math

import pytest
import torch

from ops.bounded_attention import (
    bounded_attention,
    bounded_attention_and_store,
    bounded_attention_reference,
    bounded_attention_store_op,
    bounded_attention_triton,
    write_window,
)
from tests.ops.support import DEVICE, OPCHECK_TESTS

W = 70


def random_inputs(t_values, num_heads, head_dim, num_slots=None, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(t_values)
    num_slots = num_slots or b + 1

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    q, k_new, v_new = randn(b, num_heads, head_dim), randn(b, num_heads, head_dim), randn(b, num_heads, head_dim)
    keys, values = randn(num_slots, W, num_heads, head_dim), randn(num_slots, W, num_heads, head_dim)
    pos = randn(W + 1, num_heads, head_dim)
    u, v = randn(num_heads, head_dim), randn(num_heads, head_dim)
    slots = torch.randperm(num_slots - 1, generator=g)[:b].to(device)
    t = torch.tensor(t_values, dtype=torch.int64, device=device)
    return q, k_new, v_new, keys, values, pos, u, v, slots, t


@pytest.mark.parametrize("t_values", [[0], [1], [35], [69], [70], [71, 140, 233], [0, 1, 35, 69, 70, 71, 100, 5]])
@pytest.mark.parametrize("head_dim", [16, 12])  # 12: a head dim that is not a power of two (masked lanes)
def test_kernel_matches_reference(t_values, head_dim):
    inputs = random_inputs(t_values, num_heads=2, head_dim=head_dim, device=DEVICE)
    got = bounded_attention_triton(*inputs)
    want = bounded_attention_reference(*inputs)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)  # fp32 both; only summation order differs


def test_kernel_padding_rows_share_the_sink():
    # Two padding rows point at the sink slot next to real rows; real rows must be unaffected.
    q, k_new, v_new, keys, values, pos, u, v, slots, t = random_inputs([3, 80, 0, 0], num_heads=2, head_dim=16,
                                                                        num_slots=6, device=DEVICE)
    slots = torch.tensor([1, 4, 5, 5], device=DEVICE)
    got = bounded_attention_triton(q, k_new, v_new, keys, values, pos, u, v, slots, t)
    alone = bounded_attention_reference(q[:2], k_new[:2], v_new[:2], keys, values, pos, u, v, slots[:2], t[:2])
    torch.testing.assert_close(got[:2], alone, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_variant_equals_attention_then_write_window(dtype):
    """bounded_attention_and_store (the kernel storing each row's new k/v at t % W after reading its
    window) = bounded_attention + write_window: the same output (the window read before the store: at
    t >= W the overwritten position held frame t - W, which the query must see) and the same pools,
    bit for bit, other slots and positions untouched. Two padding rows share the sink slot."""
    t_values = [0, 5, 69, 70, 71, 140, 3, 3]
    inputs = list(random_inputs(t_values, num_heads=2, head_dim=12, num_slots=9, dtype=dtype, device=DEVICE, seed=3))
    inputs[8] = torch.tensor([4, 0, 2, 6, 1, 5, 8, 8], device=DEVICE)  # rows 6, 7: the sink (slot 8)
    keys, values = inputs[3], inputs[4]
    want_keys, want_values = keys.clone(), values.clone()
    want = bounded_attention_triton(*inputs[:3], want_keys, want_values, *inputs[5:])
    write_window(want_keys, want_values, inputs[8], inputs[9], inputs[1], inputs[2])
    got = bounded_attention_and_store(*inputs)
    assert torch.equal(got[:6], want[:6])
    assert torch.equal(keys[:8], want_keys[:8]) and torch.equal(values[:8], want_values[:8])
    assert not torch.equal(keys[:8], inputs[3].new_zeros(keys[:8].shape))  # sanity: pools are real data


def test_store_op_opcheck():
    inputs = random_inputs([0, 70, 71], num_heads=2, head_dim=8, device=DEVICE, seed=4)
    torch.library.opcheck(bounded_attention_store_op, tuple(x.clone() for x in inputs), test_utils=OPCHECK_TESTS)


def plain_attention(q, u, v, seq_k, seq_v, pos, t):
    """Spec 2.4 for one query at frame t of one call: keys j in [max(0, t-W), t], bias P[t - j]."""
    js = list(range(max(0, t - W), t + 1))
    scores = torch.stack([((q + u) * seq_k[j]).sum(-1) + ((q + v) * pos[t - j]).sum(-1) for j in js], dim=-1)
    probs = torch.softmax(scores / math.sqrt(q.shape[-1]), dim=-1)  # [H, n]
    return torch.einsum("hn,nhd->hd", probs, torch.stack([seq_v[j] for j in js]))


def test_ring_window_equals_the_plain_definition():
    # Calls of different lengths fill their rings through write_window, frame by frame; at chosen frames
    # the reference over the ring must equal attention over the call's whole history.
    g = torch.Generator().manual_seed(1)
    heads, dim, slots_total = 2, 8, 4
    keys = torch.randn(slots_total, W, heads, dim, generator=g)  # stale garbage: must never be read
    values = torch.randn(slots_total, W, heads, dim, generator=g)
    pos = torch.randn(W + 1, heads, dim, generator=g)
    u, v = torch.randn(heads, dim, generator=g), torch.randn(heads, dim, generator=g)
    lengths = {2: 150, 0: 71, 1: 5}  # slot -> frames of that call
    seqs = {s: (torch.randn(n, heads, dim, generator=g), torch.randn(n, heads, dim, generator=g),
                torch.randn(n, heads, dim, generator=g)) for s, n in lengths.items()}  # q, k, v per frame
    checked = 0
    for t in range(max(lengths.values())):
        active = [s for s, n in lengths.items() if t < n]
        slots = torch.tensor(active)
        tt = torch.full((len(active),), t, dtype=torch.int64)
        q = torch.stack([seqs[s][0][t] for s in active])
        k = torch.stack([seqs[s][1][t] for s in active])
        vv = torch.stack([seqs[s][2][t] for s in active])
        out = bounded_attention_reference(q, k, vv, keys, values, pos, u, v, slots, tt)
        if t in (0, 1, 4, 69, 70, 71, 100, 149):
            for row, s in enumerate(active):
                want = plain_attention(q[row], u, v, seqs[s][1], seqs[s][2], pos, t)
                torch.testing.assert_close(out[row], want, atol=1e-5, rtol=1e-5)
                checked += 1
        write_window(keys, values, slots, tt, k, vv)
    assert checked >= 15


def test_write_window_touches_only_its_slots():
    g = torch.Generator().manual_seed(2)
    keys, values = torch.randn(5, W, 2, 4, generator=g), torch.randn(5, W, 2, 4, generator=g)
    before_k, before_v = keys.clone(), values.clone()
    slots, t = torch.tensor([3, 0, 4]), torch.tensor([75, 2, 9])
    k_new, v_new = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    write_window(keys, values, slots, t, k_new, v_new)
    expected_k, expected_v = before_k.clone(), before_v.clone()
    for row, (s, tt) in enumerate(zip(slots.tolist(), t.tolist())):
        expected_k[s, tt % W], expected_v[s, tt % W] = k_new[row], v_new[row]
    assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)


@pytest.mark.gpu
def test_store_variant_full_shapes_gpu():
    """The fused store at the encoder's full shape (H=8, Dh=128, bf16, 128 calls at every window fill):
    output and pools equal bounded_attention + write_window bit for bit on the real rows."""
    t_values = [(i * 7) % 160 for i in range(126)] + [0, 0]
    inputs = list(random_inputs(t_values, num_heads=8, head_dim=128, num_slots=257, dtype=torch.bfloat16,
                                device="cuda", seed=5))
    inputs[8][-2:] = 256
    want_keys, want_values = inputs[3].clone(), inputs[4].clone()
    want = bounded_attention(*inputs[:3], want_keys, want_values, *inputs[5:])
    write_window(want_keys, want_values, inputs[8], inputs[9], inputs[1], inputs[2])
    got = bounded_attention_and_store(*inputs)
    assert torch.equal(got[:-2], want[:-2])
    assert torch.equal(inputs[3][:256], want_keys[:256]) and torch.equal(inputs[4][:256], want_values[:256])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_kernel_full_shapes_gpu(dtype, tol):
    # Full encoder shapes: H=8, Dh=128, W=70, B=128 calls at every kind of window fill, + sink padding.
    t_values = [(i * 7) % 160 for i in range(120)] + [0, 1, 35, 69, 70, 71, 0, 0]
    inputs = list(random_inputs(t_values, num_heads=8, head_dim=128, num_slots=257, dtype=dtype, device="cuda"))
    inputs[8][-2:] = 256  # two padding rows on the sink slot
    got = bounded_attention(*inputs)
    want = bounded_attention_reference(*inputs)  # fp32 maths on the same (rounded) inputs
    assert got.dtype == dtype
    torch.testing.assert_close(got.float()[:-2], want.float()[:-2], atol=tol, rtol=tol)
