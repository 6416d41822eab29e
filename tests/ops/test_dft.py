"""ops/dft.py: matmul real DFT / inverse real DFT vs torch.fft, Triton kernel (interpreted on CPU) vs
the torch reference, and full-shape GPU tests.

Tolerance (fp32): max |ours - torch.fft in float64| <= 1e-5 * max |reference| (relative to the signal's
scale, so near-zero entries do not make an elementwise ratio meaningless)."""
import pytest
import torch

from ops.dft import GPU_TILES, basis_matmul_reference, basis_matmul_triton, irdft, irdft_basis, rdft, rdft_basis

RTOL = 1e-5
# Direct kernel calls: on CUDA when there is a GPU, else through the interpreter (conftest sets it).
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _close(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max abs error relative to the largest reference magnitude."""
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("n", [16, 512, 15])
def test_rdft_matches_torch_rfft(n):
    gen = torch.Generator().manual_seed(n)
    frames = torch.randn(3, 5, n, generator=gen)
    re, im = rdft(frames)
    ref = torch.fft.rfft(frames.double(), dim=-1)
    assert re.shape == im.shape == (3, 5, n // 2 + 1)
    assert re.dtype == im.dtype == torch.float32
    assert _close(re, ref.real) <= RTOL
    assert _close(im, ref.imag) <= RTOL


@pytest.mark.parametrize("n", [16, 512, 15])
def test_irdft_matches_torch_irfft(n):
    gen = torch.Generator().manual_seed(100 + n)
    bins = n // 2 + 1
    re = torch.randn(4, 3, bins, generator=gen)
    im = torch.randn(4, 3, bins, generator=gen)  # nonzero Im at DC (and Nyquist): must be ignored
    frames = irdft(re, im, n)
    ref = torch.fft.irfft(torch.complex(re.double(), im.double()), n=n, dim=-1)
    assert frames.shape == (4, 3, n)
    assert _close(frames, ref) <= RTOL
    # Ignoring Im(DC) / Im(Nyquist) is the documented irfft semantics: zeroing them changes nothing.
    im_zeroed = im.clone()
    im_zeroed[..., 0] = 0
    if n % 2 == 0:
        im_zeroed[..., -1] = 0
    assert torch.equal(irdft(re, im_zeroed, n), frames)


@pytest.mark.parametrize("n", [16, 512])
def test_round_trip(n):
    gen = torch.Generator().manual_seed(7)
    frames = torch.randn(6, n, generator=gen)
    back = irdft(*rdft(frames), n)
    assert _close(back, frames) <= RTOL


@pytest.mark.parametrize("n,rows", [(16, 70), (16, 1), (512, 33)])
def test_triton_kernel_matches_reference(n, rows):
    """Row counts that are not a multiple of the tile, both transforms."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, n, generator=gen)
    forward = rdft_basis(n, "cpu")
    triton_out = basis_matmul_triton(x.to(KERNEL_DEVICE), forward.to(KERNEL_DEVICE)).cpu()
    assert _close(triton_out, basis_matmul_reference(x, forward)) <= RTOL
    spectrum = torch.randn(rows, 2 * (n // 2 + 1), generator=gen)
    inverse = irdft_basis(n, "cpu")
    triton_out = basis_matmul_triton(spectrum.to(KERNEL_DEVICE), inverse.to(KERNEL_DEVICE)).cpu()
    assert _close(triton_out, basis_matmul_reference(spectrum, inverse)) <= RTOL


@pytest.mark.parametrize("n,rows", [(16, 70), (40, 70)])
def test_triton_kernel_gpu_tiles(n, rows):
    """The GPU tile sizes on the interpreter: several row tiles, a masked reduction loop (K = 42 over
    steps of 32 for the inverse) and masked output columns (N = 42 in a 64-wide tile)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(rows, n, generator=gen)
    forward = rdft_basis(n, "cpu")
    out = basis_matmul_triton(x.to(KERNEL_DEVICE), forward.to(KERNEL_DEVICE), GPU_TILES).cpu()
    assert _close(out, x.double() @ forward.double()) <= RTOL
    spectrum = torch.randn(rows, 2 * (n // 2 + 1), generator=gen)
    inverse = irdft_basis(n, "cpu")
    out = basis_matmul_triton(spectrum.to(KERNEL_DEVICE), inverse.to(KERNEL_DEVICE), GPU_TILES).cpu()
    assert _close(out, spectrum.double() @ inverse.double()) <= RTOL


def test_reference_path_for_float64():
    """Non-fp32 inputs take the torch reference with a basis of their own dtype."""
    gen = torch.Generator().manual_seed(3)
    frames = torch.randn(2, 16, generator=gen, dtype=torch.float64)
    re, im = rdft(frames)
    ref = torch.fft.rfft(frames)
    assert re.dtype == torch.float64
    assert (re - ref.real).abs().max() <= 1e-12 and (im - ref.imag).abs().max() <= 1e-12


def test_basis_cached_and_shaped():
    a = rdft_basis(16, "cpu", torch.float32)
    assert a is rdft_basis(16, torch.device("cpu"), torch.float32)
    assert a.shape == (16, 18) and irdft_basis(16, "cpu").shape == (18, 16)
    assert rdft_basis(16, "cpu", torch.float64).dtype == torch.float64


def test_compiled_step_takes_the_basis_as_a_constant():
    """torch.compile traces through lru_cache: without `assume_constant_result` the traced graph rebuilt
    each basis on every call (~20 ops each: arange, outer, cos, sin in float64 on the CPU, then a copy to
    the device). Called as the model calls them (n from the frame's shape; the codec's n_fft a module
    attribute), the compiled graphs now build nothing and give the eager result."""
    traced = []

    def record_ops(gm, inputs):
        traced.append({str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")})
        return gm.forward

    class Head(torch.nn.Module):  # the codec's iSTFT holds its n_fft as an attribute
        def __init__(self, n_fft):
            super().__init__()
            self.n_fft = n_fft

        def forward(self, re, im):
            return irdft(re, im, self.n_fft)

    for n in (16, 400):
        x = torch.randn(3, n)
        # dynamic=False as graphs/capture.py compiles the step: the frame length is a constant there
        re, im = torch.compile(rdft, backend=record_ops, fullgraph=True, dynamic=False)(x)
        back = torch.compile(Head(n), backend=record_ops, fullgraph=True, dynamic=False)(re, im)
        want_re, want_im = rdft(x)
        assert torch.equal(re, want_re) and torch.equal(im, want_im)
        assert torch.equal(back, irdft(want_re, want_im, n))
        assert (back - x).abs().max() <= 1e-4
    builds = [op for ops in traced for op in ops if any(k in op for k in ("arange", "cos", "sin", "outer"))]
    assert len(traced) == 4 and not builds, (builds, traced)


def test_irdft_rejects_wrong_bins():
    with pytest.raises(ValueError):
        irdft(torch.zeros(2, 8), torch.zeros(2, 8), 16)


@pytest.mark.gpu
@pytest.mark.parametrize("n,rows", [(16, 441 * 64), (512, 17 * 64)])
def test_gpu_full_shapes_ieee_even_with_tf32_on(n, rows):
    """Codec iSTFT (441 spectrogram frames x 64 calls) and mel front end (17 columns x 64 calls) sizes, with
    TF32 allowed globally: the kernel's tl.dot is IEEE, so the fp32 tolerance must still hold (TF32 would
    give ~1e-3)."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        gen = torch.Generator().manual_seed(n)
        frames = torch.randn(rows, n, generator=gen)
        re, im = rdft(frames.cuda())
        ref = torch.fft.rfft(frames.double(), dim=-1)
        assert _close(re.cpu(), ref.real) <= RTOL and _close(im.cpu(), ref.imag) <= RTOL
        spec_re = torch.randn(rows, n // 2 + 1, generator=gen)
        spec_im = torch.randn(rows, n // 2 + 1, generator=gen)
        out = irdft(spec_re.cuda(), spec_im.cuda(), n)
        ref = torch.fft.irfft(torch.complex(spec_re.double(), spec_im.double()), n=n, dim=-1)
        assert _close(out.cpu(), ref) <= RTOL
    finally:
        matmul.fp32_precision = saved


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    """The inverse DFT replays inside a CUDA graph with new inputs."""
    re = torch.randn(8 * 441, 9, device="cuda")
    im = torch.randn(8 * 441, 9, device="cuda")
    irdft(re, im, 16)  # warm-up: compile the kernel and build the basis outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = irdft(re, im, 16)
    re.copy_(torch.randn_like(re))
    im.copy_(torch.randn_like(im))
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.fft.irfft(torch.complex(re.double(), im.double()), n=16, dim=-1)
    assert _close(out, ref) <= RTOL
