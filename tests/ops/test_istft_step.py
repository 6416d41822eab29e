"""ops/istft_step.py: the codec's streaming iSTFT tail kernel (TRITON_INTERPRET=1 on the CPU; the full frame
step's shape on the GPU) against its torch reference, which must be the statements decode_step ran before.

Tolerance: |kernel - reference| <= ATOL + RTOL |reference| elementwise, ATOL = RTOL = 1e-5. The codec's output
is bounded by 1 in magnitude (|w clamp(x, -w, w)| <= w^2, divided by the sum of w^2), so ATOL is 1e-5 of the
signal's scale; RTOL covers the samples a garbage state (random tails, as a test feeds) divides by a small
envelope. What differs: the inverse DFT's multiply-adds summed in another order (terms up to ~100 / 8 that
cancel to |frame| <= 1, so a few fp32 ulps of 12 each) and exp / cos / sin a few ulps apart (numpy's or the
GPU's against ATen's). Measured: 1.8e-6 at most on the interpreter (8 seeds of these inputs), 1.9e-6 on the
H200 (test_gpu_full_shape: wav 1.91e-6 with max |wav| 96.2, ola_tail 1.13e-6).
The envelope tails and frames_done are exact (the same adds; an integer), and state rows not in `slots` are
untouched bit for bit."""
import math

import pytest
import torch

from ops.dft import irdft_basis
from ops.istft_step import (
    hann_window,
    istft_step,
    istft_step_op,
    istft_step_reference,
    istft_step_triton,
    overlap_add,
    synthesis_frames,
    window_envelope,
)
from tests.ops.support import DEVICE, OPCHECK_TESTS

ATOL = RTOL = 1e-5


def _constants(num_frames: int, n_fft: int, hop: int, device=DEVICE):
    """RVQCodec's step constants for these sizes (window, inner_bins, envelope, step_head)."""
    inner = torch.ones(n_fft // 2 + 1, device=device)
    inner[0] = inner[-1] = 0.0
    envelope = window_envelope(num_frames, n_fft, hop, torch.device(device))
    step_head = torch.arange(num_frames * hop, device=device) < (n_fft - hop) // 2
    return hann_window(n_fft, torch.device(device)), inner, envelope, step_head


def _head(gen, batch: int, num_frames: int, n_fft: int, device=DEVICE) -> torch.Tensor:
    """Log-magnitudes around ln 100 - 2 with a wide spread (|X| from ~0 to the 100 it saturates at; a few far
    below -15, where softplus takes its linear branch), phases a few radians either way."""
    bins = n_fft // 2 + 1
    head = torch.randn(batch, num_frames, n_fft + 2, generator=gen)
    head[..., :bins] = 2.0 * head[..., :bins] + 2.0
    head[..., bins:] *= 2.0
    head[0, 0, 1], head[0, -1, 2] = -25.0, -40.0
    return head.to(device)


def _state(gen, num_slots: int, tail: int, device=DEVICE):
    """Garbage tails (as a pool holds before admission's reset) and frames_done 0 (a stream's start) or not."""
    return (torch.randn(num_slots, tail, generator=gen).to(device),
            torch.rand(num_slots, tail, generator=gen).to(device),
            torch.tensor([0, 3, 0, 1, 7, 0, 2, 5][:num_slots], device=device))


def _clone(state):
    return tuple(t.clone() for t in state)


def _assert_step(wav, state, ref_wav, ref_state, before, slots):
    ola, env, done = state
    ref_ola, ref_env, ref_done = ref_state
    assert wav.dtype == torch.float32 and wav.shape == ref_wav.shape
    torch.testing.assert_close(wav, ref_wav, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ola, ref_ola, rtol=RTOL, atol=ATOL)
    assert torch.equal(env, ref_env) and torch.equal(done, ref_done)
    others = torch.ones(ola.shape[0], dtype=torch.bool, device=ola.device)
    others[slots] = False
    for new, old in zip(state, before):  # rows not in `slots`: untouched, bit for bit
        assert torch.equal(new[others], old[others])


@pytest.mark.parametrize("n_fft,hop,num_frames,block_t", [
    (16, 4, 441, None),   # the codec's sizes, one program per row (the interpreter's choice)
    (16, 4, 441, 32),     # the GPU's split of a row: 14 programs, the first also writes the state
    (16, 4, 37, 16),      # a last block part full
    (16, 4, 2, None),     # a step shorter than the tail: the new tails include the old ones
    (12, 4, 50, 16),      # other transform sizes: 7 bins, 3 overlapping frames
    (18, 6, 29, 16),      # a hop that is not a power of 2
])
def test_kernel_matches_reference(n_fft, hop, num_frames, block_t):
    """Slots out of order and not all of them, rows at a stream's start and past it."""
    gen = torch.Generator().manual_seed(n_fft * 1000 + num_frames)
    head = _head(gen, 5, num_frames, n_fft)
    constants = _constants(num_frames, n_fft, hop)
    state = _state(gen, 8, n_fft - hop)
    slots = torch.tensor([6, 1, 2, 0, 4], device=DEVICE)  # frames_done 2, 3, 0, 0, 7; rows 3, 5, 7 not stepped
    ref_state, kernel_state = _clone(state), _clone(state)
    ref = istft_step_reference(head, *constants, *ref_state, slots, hop)
    wav = istft_step_triton(head, irdft_basis(n_fft, DEVICE), *constants, *kernel_state, slots, hop, block_t=block_t)
    _assert_step(wav, kernel_state, ref, ref_state, state, slots)
    delay = (n_fft - hop) // 2
    starting = state[2][slots] == 0
    assert torch.equal(wav[starting, :delay], torch.zeros(int(starting.sum()), delay, device=DEVICE))
    assert (wav[~starting, :delay] != 0).all()
    assert torch.equal(kernel_state[2][slots], state[2][slots] + 1)


def test_repeated_steps_carry_state():
    """Six steps, each with its own batch order (a padding row on the sink), a slot reset (frames_done 0) in
    between: the kernel's state carries from step to step as the reference's does, and each step's output
    matches. One program per row and the GPU's split alternate."""
    gen = torch.Generator().manual_seed(5)
    n_fft, hop, num_frames = 16, 4, 41
    constants = _constants(num_frames, n_fft, hop)
    state = _state(gen, 6, n_fft - hop)
    ref_state, kernel_state = _clone(state), _clone(state)
    for step, slots in enumerate([[0, 1, 5], [1, 0, 5], [2, 1, 0, 5], [0, 2, 5], [5, 1, 2, 0], [3, 5]]):
        if step == 3:  # slot 1's call ends, a new one is admitted on it later
            for pool in (ref_state, kernel_state):
                for tensor in pool:
                    tensor[1] = 0
        slots = torch.tensor(slots, device=DEVICE)
        head = _head(gen, len(slots), num_frames, n_fft)
        before = _clone(kernel_state)
        ref = istft_step_reference(head, *constants, *ref_state, slots, hop)
        wav = istft_step_triton(head, irdft_basis(n_fft, DEVICE), *constants, *kernel_state, slots, hop,
                                block_t=16 if step % 2 else None)
        _assert_step(wav, kernel_state, ref, ref_state, before, slots)
    assert kernel_state[2].tolist() == [5, 1, 3, 2, 7, 6]   # the sink (5) stepped every time


def test_reference_is_the_decode_step_statements():
    """The reference computes what decode_step's statements did (synthesis_frames and overlap_add, then the
    bookkeeping), bit for bit."""
    gen = torch.Generator().manual_seed(3)
    n_fft, hop, num_frames = 16, 4, 441
    head = _head(gen, 3, num_frames, n_fft, "cpu")
    window, inner, step_envelope, step_head = _constants(num_frames, n_fft, hop, "cpu")
    state = _state(gen, 4, n_fft - hop, "cpu")
    slots = torch.tensor([2, 0, 1])
    ola_tail, envelope_tail, frames_done = _clone(state)
    frames = synthesis_frames(head, n_fft, by_matmul=True, window=window, inner_bins=inner)
    signal = overlap_add(frames, hop)
    envelope = step_envelope.expand_as(signal)
    tail = n_fft - hop
    signal = torch.cat([signal[:, :tail] + ola_tail.index_select(0, slots), signal[:, tail:]], dim=1)
    envelope = torch.cat([envelope[:, :tail] + envelope_tail.index_select(0, slots), envelope[:, tail:]], dim=1)
    done = frames_done.index_select(0, slots)
    out_len = hop * num_frames
    want = torch.where((done[:, None] == 0) & step_head, 0.0, signal[:, :out_len] / envelope[:, :out_len])
    ola_tail.index_copy_(0, slots, signal[:, out_len:])
    envelope_tail.index_copy_(0, slots, envelope[:, out_len:])
    frames_done.index_copy_(0, slots, done + 1)
    ref_state = _clone(state)
    got = istft_step_reference(head, window, inner, step_envelope, step_head, *ref_state, slots, hop)
    assert torch.equal(got, want)
    for a, b in zip(ref_state, (ola_tail, envelope_tail, frames_done)):
        assert torch.equal(a, b)


def test_nan_propagates_as_in_torch():
    """A NaN in a row's head makes its output NaN past the before-start zeros, as torch.clamp does (the
    GPU's plain min / max would drop it); other rows stay finite."""
    gen = torch.Generator().manual_seed(9)
    n_fft, hop, num_frames = 16, 4, 20
    head = _head(gen, 3, num_frames, n_fft)
    head[1, 7, 12] = float("nan")   # a phase of frame 7
    head[2, :, 0] = float("nan")    # every frame's DC magnitude, at a stream's start (slot 2: frames_done 0)
    constants = _constants(num_frames, n_fft, hop)
    state = _state(gen, 4, n_fft - hop)
    slots = torch.tensor([1, 3, 2], device=DEVICE)
    ref_state, kernel_state = _clone(state), _clone(state)
    ref = istft_step_reference(head, *constants, *ref_state, slots, hop)
    wav = istft_step_triton(head, irdft_basis(n_fft, DEVICE), *constants, *kernel_state, slots, hop)
    assert torch.equal(wav.isnan(), ref.isnan()) and wav[1].isnan().any() and wav[0].isfinite().all()
    assert torch.equal(wav[2, :6], torch.zeros(6, device=DEVICE)) and wav[2, 6:].isnan().all()
    assert torch.equal(kernel_state[0].isnan(), ref_state[0].isnan())
    finite = ~ref.isnan()
    torch.testing.assert_close(wav[finite], ref[finite], rtol=RTOL, atol=ATOL)


def test_custom_op_schema_and_compile():
    """opcheck (schema with its three in-place state pools, fake shapes), and a fullgraph-compiled call of the
    dispatcher gives the eager result and updates the state once."""
    gen = torch.Generator().manual_seed(11)
    n_fft, hop, num_frames = 16, 4, 24
    head = _head(gen, 2, num_frames, n_fft)
    constants = _constants(num_frames, n_fft, hop)
    state = _state(gen, 3, n_fft - hop)
    slots = torch.tensor([2, 0], device=DEVICE)
    torch.library.opcheck(istft_step_op, (head, irdft_basis(n_fft, DEVICE), *constants, *_clone(state), slots, hop),
                          test_utils=OPCHECK_TESTS)
    eager_state, compiled_state = _clone(state), _clone(state)
    eager = istft_step(head, *constants, *eager_state, slots, hop)
    step = torch.compile(istft_step, fullgraph=True, backend="aot_eager")
    compiled = step(head, *constants, *compiled_state, slots, hop)
    assert torch.equal(compiled, eager)
    for c, e in zip(compiled_state, eager_state):
        assert torch.equal(c, e)


@pytest.mark.gpu
def test_gpu_full_shape():
    """The frame step at 32 calls: head [32, 441, 18], a 129-row pool (128 calls + the sink), slots spread and
    out of order, against the reference on the GPU; prints the largest difference (the docstring's figure)."""
    gen = torch.Generator().manual_seed(13)
    n_fft, hop, num_frames, batch = 16, 4, 441, 32
    head = _head(gen, batch, num_frames, n_fft, "cuda")
    constants = _constants(num_frames, n_fft, hop, "cuda")
    state = (torch.randn(129, n_fft - hop, generator=gen).cuda(), torch.rand(129, n_fft - hop, generator=gen).cuda(),
             torch.randint(0, 3, (129,), generator=gen).cuda())
    slots = torch.randperm(129, generator=gen)[:batch].cuda()
    ref_state, kernel_state = _clone(state), _clone(state)
    ref = istft_step_reference(head, *constants, *ref_state, slots, hop)
    wav = istft_step(head, *constants, *kernel_state, slots, hop)
    print(f"max |kernel - reference|: wav {(wav - ref).abs().max().item():.3g} (max |wav| "
          f"{ref.abs().max().item():.3g}), ola_tail {(kernel_state[0] - ref_state[0]).abs().max().item():.3g}")
    _assert_step(wav, kernel_state, ref, ref_state, state, slots)
    assert math.isfinite(wav.abs().max().item())
