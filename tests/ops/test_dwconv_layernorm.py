"""Causal depthwise conv + LayerNorm kernel (TRITON_INTERPRET=1 on CPU; full codec shapes on the GPU) vs its
torch reference (cat of the history, F.conv1d with groups=C, F.layer_norm) and vs float64.
Tolerances: fp32 in and out; 7-tap sums and a LayerNorm in a different order than ATen/cuDNN: within 1e-5
(rtol and atol) of the reference and of float64 (outputs are O(1) after the norm)."""
import pytest
import torch
import torch.nn.functional as F

from ops.dwconv_layernorm import (
    dwconv_layer_norm,
    dwconv_layer_norm_op,
    dwconv_layer_norm_reference,
    dwconv_layer_norm_triton,
)
from tests.ops.support import DEVICE, OPCHECK_TESTS

EPS = 1e-6  # the codec's ConvNeXt LayerNorm (spec 5.2)


def _inputs(gen, batch, length, channels, num_slots=7, ksize=7, device=DEVICE):
    r = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    x = 2 * r(batch, length, channels) + 0.5
    history = r(num_slots, ksize - 1, channels)
    slots = torch.randperm(num_slots, generator=gen)[:batch].to(device)
    conv_w = r(channels, 1, ksize) * ksize ** -0.5
    conv_b, norm_w, norm_b = 0.1 * r(channels), 1 + 0.1 * r(channels), 0.1 * r(channels)
    return x, history, slots, conv_w, conv_b, norm_w, norm_b


def _float64(x, history, slots, conv_w, conv_b, norm_w, norm_b, eps):
    """The same computation written out in float64, tap by tap."""
    padded = torch.cat([history[slots], x], dim=1).double()
    ksize, length = conv_w.shape[-1], x.shape[1]
    h = conv_b.double() + sum(padded[:, j:j + length] * conv_w[:, 0, j].double() for j in range(ksize))
    centred = h - h.mean(-1, keepdim=True)
    return centred / torch.sqrt((centred ** 2).mean(-1, keepdim=True) + eps) * norm_w.double() + norm_b.double()


@pytest.mark.parametrize("batch,length,channels", [(3, 9, 48), (2, 20, 100), (4, 3, 64), (1, 1, 24)])
def test_kernel_matches_reference_and_float64(batch, length, channels):
    """Lengths below, at and above the history (3, 9, 20: taps from the history only for the first k-1
    frames), a width that is not a power of two (100: masked channels) and a single frame."""
    gen = torch.Generator().manual_seed(batch * 1000 + length * 10 + channels)
    args = _inputs(gen, batch, length, channels)
    out = dwconv_layer_norm_triton(*args, EPS)
    assert out.shape == (batch, length, channels) and out.dtype == torch.float32
    torch.testing.assert_close(out, dwconv_layer_norm_reference(*args, EPS), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), _float64(*args, EPS), rtol=1e-5, atol=1e-5)


def test_reads_only_its_slots_history():
    """Rows read history[slots[b]] and nothing else: changing another slot's history changes nothing, and
    changing a used slot's history changes exactly its row's first k-1 frames."""
    gen = torch.Generator().manual_seed(5)
    x, history, slots, *rest = _inputs(gen, 2, 12, 32, num_slots=5)
    out = dwconv_layer_norm(x, history, slots, *rest, EPS)
    unused = next(s for s in range(5) if s not in slots.tolist())
    other = history.clone()
    other[unused] += 100.0
    assert torch.equal(dwconv_layer_norm(x, other, slots, *rest, EPS), out)
    changed = history.clone()
    changed[slots[1]] += 1.0
    moved = dwconv_layer_norm(x, changed, slots, *rest, EPS)
    assert torch.equal(moved[0], out[0]) and torch.equal(moved[1, 6:], out[1, 6:])
    assert (moved[1, :6] != out[1, :6]).all(dim=-1).all()


def test_strided_input_and_opcheck():
    gen = torch.Generator().manual_seed(6)
    x, history, slots, *rest = _inputs(gen, 3, 10, 40)
    wide = torch.randn(3, 10, 56, generator=gen).to(DEVICE)
    wide[..., 8:48] = x
    out = dwconv_layer_norm(wide[..., 8:48], history, slots, *rest, EPS)  # channel-contiguous, row-strided
    torch.testing.assert_close(out, dwconv_layer_norm_reference(x, history, slots, *rest, EPS), rtol=1e-5, atol=1e-5)
    torch.library.opcheck(dwconv_layer_norm_op, (x, history, slots, *rest, EPS), test_utils=OPCHECK_TESTS)


@pytest.mark.gpu
@pytest.mark.parametrize("channels,length", [(1536, 9), (768, 63), (384, 441)])
def test_gpu_codec_shapes(channels, length):
    """The decoder's three stages for one code frame per call at N=128 (spec 5.2: 9, 63, 441 frames)."""
    gen = torch.Generator().manual_seed(channels)
    args = _inputs(gen, 128, length, channels, num_slots=160, device="cuda")
    out = dwconv_layer_norm(*args, EPS)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        ref = dwconv_layer_norm_reference(*args, EPS)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), _float64(*args, EPS), rtol=1e-5, atol=1e-5)
    assert F.mse_loss(out, ref).item() < 1e-12
