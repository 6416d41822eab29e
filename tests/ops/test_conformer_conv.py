"""Conformer conv-module step kernel (GLU -> cache shift -> depthwise conv -> LayerNorm -> SiLU; TRITON_INTERPRET=1
on CPU) vs its torch reference (the streaming encoder's former torch ops) and vs float64; full shapes on the GPU.
Tolerances: fp32 output within 1e-5 (rtol and atol) of the reference (reduction order, exp); bf16 output
>= 99% bit-identical with the rest within one bf16 step (rtol 2^-7) or 1e-5 absolute (values that cancel to
near zero in the norm). Cache: the k-2 taps carried over are copies, bit-identical; the new tap is the
kernel's GLU output, bit-identical in bf16 but for a rare rounding flip (then one step), within 1e-6 in fp32
(its exp is not torch's); slots no real row names are untouched. Padding rows share the sink slot (the
last), whose contents and outputs are garbage by design: they are not compared."""
import pytest
import torch
import torch.nn.functional as F

from ops.conformer_conv import (
    conformer_conv_step,
    conformer_conv_step_op,
    conformer_conv_step_reference,
    conformer_conv_step_triton,
)
from tests.ops.support import DEVICE, OPCHECK_TESTS, assert_norm_output

EPS = 1e-5


def _inputs(gen, batch, d, kernel, slots_count, dtype, device=DEVICE):
    r = lambda *s: torch.randn(*s, generator=gen, device=gen.device).to(device)  # noqa: E731
    h = (2 * r(batch, 2 * d)).to(dtype)
    cache = r(slots_count, d, kernel - 1).to(dtype)
    conv_w = (r(d, 1, kernel) / kernel ** 0.5).to(dtype)
    norm_w = (1 + 0.1 * r(d)).to(dtype)
    norm_b = (0.1 * r(d)).to(dtype)
    return h, cache, conv_w, norm_w, norm_b


def _float64(h, cache, slots, conv_w, norm_w, norm_b, eps):
    """The module written out in float64 with the op's roundings of glu (kept in the cache) and of the conv."""
    dtype, d = h.dtype, h.shape[1] // 2
    a, g = h.double()[:, :d], h.double()[:, d:]
    glu = (a * torch.sigmoid(g)).to(dtype).double()
    window = torch.cat([cache[slots].double(), glu[:, :, None]], dim=2)
    conv = (window * conv_w.double()[:, 0][None]).sum(-1).to(dtype).double()
    centred = conv - conv.mean(-1, keepdim=True)
    y = (centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + eps) * norm_w.double()
         + norm_b.double()).to(dtype).double()
    return y * torch.sigmoid(y), window[:, :, 1:]


def _close_to_float64_cache(got, want, dtype):
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=0)
    torch.testing.assert_close(got.double(), want, **tol)


def _check_cache(got, want, before, real_slots, dtype):
    """Real slots: carried taps exact, new tap (GLU) as stated above; other slots but the sink untouched."""
    sink = got.shape[0] - 1
    touched = set(real_slots)
    for s in range(got.shape[0]):
        if s == sink:
            continue
        if s not in touched:
            assert torch.equal(got[s], before[s]), f"slot {s} changed"
            continue
        assert torch.equal(got[s, :, :-1], want[s, :, :-1])
        if dtype == torch.float32:
            torch.testing.assert_close(got[s, :, -1], want[s, :, -1], rtol=1e-6, atol=1e-6)
        else:
            torch.testing.assert_close(got[s, :, -1].float(), want[s, :, -1].float(), rtol=2 ** -7, atol=0)
            assert (got[s, :, -1] == want[s, :, -1]).float().mean().item() >= 0.99


# (d, kernel): the model's k = 9 at small d, a d that is not a power of two, k - 1 not a power of two, k = 2
@pytest.mark.parametrize("d,kernel", [(64, 9), (100, 9), (48, 4), (32, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference_with_padding_rows_on_the_sink(d, kernel, dtype):
    gen = torch.Generator().manual_seed(d + kernel)
    num_slots = 8  # slot 7 is the sink
    real = [5, 0, 3, 6]
    slots = torch.tensor(real + [7, 7, 7], device=DEVICE)  # three padding rows on the sink
    h, cache, conv_w, norm_w, norm_b = _inputs(gen, len(slots), d, kernel, num_slots, dtype)
    got_cache, want_cache = cache.clone(), cache.clone()
    out = conformer_conv_step_triton(h, got_cache, slots, conv_w, norm_w, norm_b, EPS)
    ref = conformer_conv_step_reference(h, want_cache, slots, conv_w, norm_w, norm_b, EPS)
    n = len(real)  # padding rows' outputs are garbage (the sink races): only real rows compared
    exact, new_cache = _float64(h[:n], cache, slots[:n], conv_w, norm_w, norm_b, EPS)
    assert_norm_output(out[:n], ref[:n], exact, dtype, bf16_exact_rtol=2 ** -6)  # its two last roundings
    _check_cache(got_cache, want_cache, cache, real, dtype)
    # and the cache against the float64 statement: shift, GLU enters last
    _close_to_float64_cache(got_cache[real], new_cache, dtype)


def test_streamed_frames_match_an_offline_causal_conv():
    """Twelve frames through the launcher, slot order shuffled each step, padding rows on the sink: each
    call's outputs equal the module's offline path (causal left padding, conv over the whole sequence)."""
    gen = torch.Generator().manual_seed(21)
    d, kernel, frames, num_slots = 40, 9, 12, 5
    calls = [1, 3, 0]
    hs, cache, conv_w, norm_w, norm_b = _inputs(gen, frames * len(calls), d, kernel, num_slots, torch.float32)
    hs = hs.view(frames, len(calls), 2 * d)
    cache[calls] = 0.0  # fresh calls (reset_slots)
    outs = torch.empty(frames, len(calls), d, device=DEVICE)
    for t in range(frames):
        order = torch.randperm(len(calls), generator=gen).tolist()
        slots = torch.tensor([calls[i] for i in order] + [num_slots - 1], device=DEVICE)
        h = torch.cat([hs[t, order], torch.randn(1, 2 * d, generator=gen).to(DEVICE)])
        out = conformer_conv_step(h, cache, slots, conv_w, norm_w, norm_b, EPS)
        outs[t, order] = out[:len(calls)]
    for i in range(len(calls)):
        glu = F.glu(hs[:, i].T[None], dim=1)  # [1, d, T]
        conv = F.conv1d(F.pad(glu, (kernel - 1, 0)), conv_w, groups=d)[0].T
        want = F.silu(F.layer_norm(conv, (d,), norm_w, norm_b, EPS))
        torch.testing.assert_close(outs[:, i], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache[calls[i]], glu[0, :, -(kernel - 1):], rtol=1e-6, atol=1e-6)


def test_opcheck():
    gen = torch.Generator().manual_seed(22)
    h, cache, conv_w, norm_w, norm_b = _inputs(gen, 3, 24, 9, 5, torch.float32)
    torch.library.opcheck(conformer_conv_step_op, (h, cache, torch.tensor([4, 0, 2], device=DEVICE), conv_w,
                                                   norm_w, norm_b, EPS),
                          test_utils=OPCHECK_TESTS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_full_shapes(dtype):
    """The encoder's shape: B = 128 rows (the last 8 padding rows on the sink), d = 1024, k = 9, against the
    torch ops on the GPU and against float64 from the same inputs (with the op's roundings: _float64)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    d, kernel, batch, num_slots = 1024, 9, 128, 200
    real = torch.randperm(num_slots - 1, generator=gen, device="cuda")[:batch - 8]
    slots = torch.cat([real, torch.full((8,), num_slots - 1, device="cuda")])
    h, cache, conv_w, norm_w, norm_b = _inputs(gen, batch, d, kernel, num_slots, dtype, device="cuda")
    got_cache, want_cache = cache.clone(), cache.clone()
    out = conformer_conv_step(h, got_cache, slots, conv_w, norm_w, norm_b, EPS)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # the reference's fp32 conv in full fp32
        ref = conformer_conv_step_reference(h, want_cache, slots, conv_w, norm_w, norm_b, EPS)
    n = batch - 8
    exact, new_cache = _float64(h[:n], cache, slots[:n], conv_w, norm_w, norm_b, EPS)
    same = (out[:n] == ref[:n]).float().mean().item()
    print(f"conformer conv step {dtype}: max |kernel - torch| {(out[:n].float() - ref[:n].float()).abs().max():.3g}, "
          f"max |kernel - float64| {(out[:n].double() - exact).abs().max():.3g}, {same:.5f} identical")
    assert_norm_output(out[:n], ref[:n], exact, dtype, bf16_exact_rtol=2 ** -6)  # its two last roundings
    _check_cache(got_cache, want_cache, cache, real.tolist(), dtype)
    _close_to_float64_cache(got_cache[real], new_cache, dtype)
