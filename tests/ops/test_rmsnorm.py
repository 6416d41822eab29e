"""RMSNorm kernel (TRITON_INTERPRET=1 on CPU) vs its torch reference and vs the models' original norms
written out in float64; full shapes on the GPU. Tolerances: fp32 outputs within 2e-6 relative of the
reference (reduction order differs); bf16 outputs within one bf16 rounding step (2^-8 relative)."""
import pytest
import torch

from ops.rmsnorm import (
    add_rms_norm,
    add_rms_norm_reference,
    add_rms_norm_triton,
    rms_norm,
    rms_norm_reference,
    rms_norm_triton,
)
from tests.ops.support import DEVICE, OPCHECK_TESTS


def _float64(x, w, eps, offset, gate=None, group=None, residual=None):
    """The norm written out in float64, independent of the reference's code."""
    h = x.double()
    if gate is not None:
        h = h * gate.double() * torch.sigmoid(gate.double())
    g = h.reshape(*h.shape[:-1], -1, group or h.shape[-1])
    g = g / torch.sqrt((g * g).mean(-1, keepdim=True) + eps)
    y = g.reshape(h.shape) * (offset + w.double())
    return y if residual is None else y + residual.double()


CASES = [  # (shape, group, offset, gate, residual): the model's uses at small sizes
    ((5, 48), None, 0.0, False, False),       # Nemotron-H RMSNorm
    ((3, 2, 40), None, 1.0, False, False),    # Gemma RMSNorm (talker hidden)
    ((4, 1, 6, 18), None, 1.0, False, False),  # q/k norm over a head dim that is not a power of two
    ((7, 64), 16, 0.0, True, False),          # Mamba-2 gated norm in 4 groups
    ((6, 40), None, 1.0, False, True),        # Gemma post-norm added to the residual
]


@pytest.mark.parametrize("shape,group,offset,gated,with_residual", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference_and_float64(shape, group, offset, gated, with_residual, dtype):
    gen = torch.Generator().manual_seed(CASES.index((shape, group, offset, gated, with_residual)))
    r = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    x = (3 * r(*shape)).to(dtype)
    w = (0.2 * r(shape[-1])).to(dtype)
    gate = r(*shape).to(dtype) if gated else None
    res = r(*shape).to(dtype) if with_residual else None
    out = rms_norm_triton(x, w, 1e-5, offset, gate, group, res)
    ref = rms_norm_reference(x, w, 1e-5, offset, gate, group, res)
    assert out.shape == x.shape and out.dtype == ref.dtype
    exact = _float64(x, w, 1e-5, offset, gate, group, res)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding (two with the residual) of the same fp32 value, to nearest even as torch
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=2 ** -7 * (2 if res is not None else 1))
        assert (out.float() == ref.float()).float().mean() > 0.95  # nearly all bit-identical


def test_gated_norm_out_dtype_and_strided_inputs():
    """The Mamba block passes row-strided slices of in_proj's output and asks for bf16 out of fp32 y."""
    gen = torch.Generator().manual_seed(3)
    proj = torch.randn(5, 100, generator=gen).to(DEVICE)
    y, z = proj[:, :32], proj[:, 40:72]  # strided rows
    w = torch.randn(32, generator=gen).to(DEVICE)
    out = rms_norm_triton(y, w, 1e-5, gate=z, group_size=8, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _float64(y, w, 1e-5, 0.0, z, 8).float(), rtol=2 ** -7, atol=1e-2)


def test_launcher_matches_model_norms():
    """The launcher (kernel here) against the LLM's and talker's modules' own reference paths."""
    from nemo_duplex.models.llm import GatedRMSNorm, RMSNorm
    from nemo_duplex.models.talker import GemmaRMSNorm
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 64, generator=gen)
    z = torch.randn(4, 64, generator=gen)
    for module, args in ((RMSNorm(64, 1e-5), (x,)), (GemmaRMSNorm(64, 1e-6), (x,)),
                         (GatedRMSNorm(64, 16, 1e-5), (x, z))):
        with torch.no_grad():
            module.weight.normal_(0, 0.3, generator=gen)
        kernel_out = module.to(DEVICE)(*(a.to(DEVICE) for a in args))  # TRITON_INTERPRET=1 here: the kernel
        want = _float64(x, module.weight.detach().cpu(), module.eps, 1.0 if isinstance(module, GemmaRMSNorm) else 0.0,
                        z if len(args) == 2 else None, getattr(module, "group_size", None))
        torch.testing.assert_close(kernel_out.double().cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width,group,offset,gated", [(128, 4480, None, 0.0, False), (256, 1152, None, 1.0, False),
                                                          (256 * 16, 72, None, 1.0, False), (128, 10240, 1280, 0.0, True)])
def test_gpu_full_shapes(rows, width, group, offset, gated):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, width, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(width, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.2
    gate = torch.randn(rows, width, device="cuda", generator=gen, dtype=torch.bfloat16) if gated else None
    out = rms_norm(x, w, 1e-5, offset, gate, group)
    ref = rms_norm_reference(x, w, 1e-5, offset, gate, group)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=2 ** -7)
    assert (out == ref).float().mean() > 0.95


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_kernel(dtype):
    """q/k norm + rotary: kernel vs reference (both round like bf16 torch ops) vs float64 written out."""
    from ops.rmsnorm import rms_norm_rope_reference, rms_norm_rope_triton
    gen = torch.Generator().manual_seed(7)
    b, t, heads, d = 3, 2, 5, 18  # d not a power of two (the talker's is 72)
    x = (2 * torch.randn(b, t, heads, d, generator=gen)).to(DEVICE, dtype)
    w = (0.2 * torch.randn(d, generator=gen)).to(DEVICE, dtype)
    angles = torch.rand(b, t, d // 2, generator=gen) * 100
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    out = rms_norm_rope_triton(x, w, 1e-6, cos, sin)
    ref = rms_norm_rope_reference(x, w, 1e-6, cos, sin)
    y = _float64(x, w, 1e-6, 1.0)
    rotated = torch.cat([-y[..., d // 2:], y[..., :d // 2]], -1)
    exact = y * cos.double()[:, :, None] + rotated * sin.double()[:, :, None]
    assert out.shape == x.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
    else:  # the kernel rounds like the reference (bf16 by bit arithmetic): identical but for rare flips
        torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=4 * 2 ** -8 * max(1.0, exact.abs().max().item()))
        assert (out == ref).float().mean().item() > 0.98
        torch.testing.assert_close(out.double(), exact, rtol=0, atol=0.1)


def _kv_store_inputs(gen, b, heads, d, num_rows, max_len, dtype, device):
    k = (2 * torch.randn(b, 1, heads, d, generator=gen)).to(device, dtype)
    v = torch.randn(b, 1, heads, d, generator=gen).to(device, dtype)
    w = (0.2 * torch.randn(d, generator=gen)).to(device, dtype)
    angles = torch.rand(b, 1, d // 2, generator=gen) * 100
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    pool_k = torch.randn(num_rows, heads, max_len, d, generator=gen).to(device, dtype)
    pool_v = torch.randn(num_rows, heads, max_len, d, generator=gen).to(device, dtype)
    rows = torch.randperm(num_rows - 1, generator=gen)[:b].to(device)
    positions = torch.randint(0, max_len, (b,), generator=gen).to(device)
    return k, w, cos, sin, v, pool_k, pool_v, rows, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_store_writes_the_pools(dtype):
    """The store variant of the norm + rotary kernel (the talker's decode-step k/v into its pools): the pools
    equal rms_norm_rope_triton's k (the same arithmetic) and v written at (rows, :, positions) bit for bit,
    everything else untouched; and the torch statements (the CPU path) within rms_norm_rope's tolerance."""
    from ops.rmsnorm import rms_norm_rope_store_reference, rms_norm_rope_store_triton, rms_norm_rope_triton
    gen = torch.Generator().manual_seed(8)
    k, w, cos, sin, v, pool_k, pool_v, rows, positions = _kv_store_inputs(gen, 4, 3, 18, 7, 11, dtype, DEVICE)
    want_k, want_v = pool_k.clone(), pool_v.clone()
    want_k[rows, :, positions] = rms_norm_rope_triton(k, w, 1e-6, cos, sin)[:, 0]
    want_v[rows, :, positions] = v[:, 0]
    ref_k, ref_v = pool_k.clone(), pool_v.clone()
    rms_norm_rope_store_reference(k, w, 1e-6, cos, sin, v, ref_k, ref_v, rows, positions)
    assert rms_norm_rope_store_triton(k, w, 1e-6, cos, sin, v, pool_k, pool_v, rows, positions) is None
    assert torch.equal(pool_k, want_k) and torch.equal(pool_v, want_v)
    assert torch.equal(pool_v, ref_v)
    torch.testing.assert_close(pool_k.float(), ref_k.float(), rtol=0, atol=4 * 2 ** -8 * 8 if dtype == torch.bfloat16
                               else 2e-6)


def _same_kernel_output(a: torch.Tensor, b: torch.Tensor) -> None:
    """Two launches of the norm + rotary arithmetic (other kernel variants, or strided against contiguous
    inputs) agree bit for bit, except in fp32 on a GPU: there `round_to` is no rounding at all, so the
    compiler may fuse a product and a sum into one FMA in one variant and not the other (the last bit moves:
    within 1e-6). bf16 rounds each step by integer arithmetic, which no compiler pass can fold away."""
    if a.is_cuda and a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_qk_store_is_both_kernels_in_one_launch(dtype):
    """rms_norm_rope_qk_store (the talker's q beside its k/v store): q what rms_norm_rope_triton makes of it
    with its own weight, the pools what the store kernel writes (bit for bit, `_same_kernel_output`); the torch
    statements (the CPU path) within rms_norm_rope's tolerance; q read from a strided view."""
    from ops.rmsnorm import (
        rms_norm_rope_qk_store,
        rms_norm_rope_qk_store_op,
        rms_norm_rope_reference,
        rms_norm_rope_store_reference,
        rms_norm_rope_store_triton,
        rms_norm_rope_triton,
    )
    gen = torch.Generator().manual_seed(10)
    k, w, cos, sin, v, pool_k, pool_v, rows, positions = _kv_store_inputs(gen, 5, 3, 18, 8, 11, dtype, DEVICE)
    wide = (2 * torch.randn(5, 1, 3, 2 * 18, generator=gen)).to(DEVICE, dtype)
    q, q_w = wide[..., 5:23], (0.2 * torch.randn(18, generator=gen)).to(DEVICE, dtype)
    want_k, want_v = pool_k.clone(), pool_v.clone()
    rms_norm_rope_store_triton(k, w, 1e-6, cos, sin, v, want_k, want_v, rows, positions)
    ref_k, ref_v = pool_k.clone(), pool_v.clone()
    rms_norm_rope_store_reference(k, w, 1e-6, cos, sin, v, ref_k, ref_v, rows, positions)
    out = rms_norm_rope_qk_store(q, q_w, k, w, 1e-6, cos, sin, v, pool_k, pool_v, rows, positions)
    assert out.shape == q.shape and out.dtype == dtype
    _same_kernel_output(out, rms_norm_rope_triton(q.contiguous(), q_w, 1e-6, cos, sin))
    _same_kernel_output(pool_k, want_k)
    assert torch.equal(pool_v, want_v)
    ref = rms_norm_rope_reference(q, q_w, 1e-6, cos, sin)
    tolerance = 4 * 2 ** -8 * 8 if dtype == torch.bfloat16 else 2e-6
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=tolerance)
    torch.testing.assert_close(pool_k.float(), ref_k.float(), rtol=0, atol=tolerance)
    assert torch.equal(pool_v, ref_v)
    k2, w2, cos2, sin2, v2, pool_k2, pool_v2, rows2, positions2 = _kv_store_inputs(
        torch.Generator().manual_seed(9), 2, 2, 8, 4, 5, torch.float32, DEVICE)
    torch.library.opcheck(rms_norm_rope_qk_store_op, (k2.clone(), w2, k2, w2, 1e-6, cos2, sin2, v2, pool_k2, pool_v2,
                                                      rows2, positions2, 1.0, None), test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("t", [1, 3])
def test_norm_rope_reads_column_slices_of_a_fused_projection(t):
    """The talker's q, k, v come from one GEMM over the stacked weights (nemo_duplex/models/talker.py
    stack_linears) as column views of [B, T, 3 x heads x D]: both kernels read them through token and head
    strides, what they compute from contiguous copies (`_same_kernel_output`), and `_token_heads` makes no copy."""
    from ops.rmsnorm import _token_heads, rms_norm_rope_store_triton, rms_norm_rope_triton
    gen = torch.Generator().manual_seed(11)
    b, heads, d, num_rows, max_len = 4, 3, 18, 6, 9
    fused = (2 * torch.randn(b, t, 3 * heads * d, generator=gen)).to(DEVICE)
    q, k, v = (part.view(b, t, heads, d) for part in fused.split(heads * d, dim=-1))
    assert not q.is_contiguous() and _token_heads(q)[0].data_ptr() == q.data_ptr()
    w = (0.2 * torch.randn(d, generator=gen)).to(DEVICE)
    angles = torch.rand(b, t, d // 2, generator=gen) * 100
    cos, sin = torch.cat([angles, angles], -1).cos().to(DEVICE), torch.cat([angles, angles], -1).sin().to(DEVICE)
    _same_kernel_output(rms_norm_rope_triton(q, w, 1e-6, cos, sin), rms_norm_rope_triton(q.contiguous(), w, 1e-6, cos, sin))
    if t == 1:
        rows = torch.randperm(num_rows, generator=gen)[:b].to(DEVICE)
        positions = torch.randint(0, max_len, (b,), generator=gen).to(DEVICE)
        pools = [torch.zeros(num_rows, heads, max_len, d, device=DEVICE) for _ in range(4)]
        rms_norm_rope_store_triton(k, w, 1e-6, cos, sin, v, pools[0], pools[1], rows, positions)
        rms_norm_rope_store_triton(k.contiguous(), w, 1e-6, cos, sin, v.contiguous(), pools[2], pools[3], rows, positions)
        _same_kernel_output(pools[0], pools[2])
        assert torch.equal(pools[1], pools[3]) and pools[1].abs().sum() > 0


@pytest.mark.gpu
def test_gpu_norm_rope_store_talker_shape():
    """The talker's shape (256 pool rows of 16 heads x 72 at 1037 positions, bf16): bit for bit as above."""
    from ops.rmsnorm import rms_norm_rope_qk_store, rms_norm_rope_triton
    gen = torch.Generator().manual_seed(10)
    k, w, cos, sin, v, pool_k, pool_v, rows, positions = _kv_store_inputs(gen, 256, 16, 72, 321, 1037,
                                                                          torch.bfloat16, "cuda")
    q = (2 * torch.randn(256, 1, 16, 72, generator=gen)).to("cuda", torch.bfloat16)
    want_k, want_v = pool_k.clone(), pool_v.clone()
    want_k[rows, :, positions] = rms_norm_rope_triton(k, w, 1e-6, cos, sin)[:, 0]
    want_v[rows, :, positions] = v[:, 0]
    out = rms_norm_rope_qk_store(q, w.flip(0), k, w, 1e-6, cos, sin, v, pool_k, pool_v, rows, positions)
    assert torch.equal(pool_k, want_k) and torch.equal(pool_v, want_v)
    assert torch.equal(out, rms_norm_rope_triton(q, w.flip(0), 1e-6, cos, sin))


@pytest.mark.gpu
def test_gpu_norm_rope_talker_shape():
    from nemo_duplex.models.talker import rotary_cos_sin
    from ops.rmsnorm import rms_norm_reference, rms_norm_rope, rms_norm_rope_reference
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 1, 16, 72, device="cuda", generator=gen, dtype=torch.bfloat16) * 2
    w = torch.randn(72, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.2
    cos, sin = rotary_cos_sin(torch.randint(0, 9000, (256, 1), device="cuda", generator=gen), 72, 1e6)
    out = rms_norm_rope(x, w, 1e-6, cos, sin)
    ref = rms_norm_rope_reference(x, w, 1e-6, cos, sin)
    y_max = rms_norm_reference(x, w, 1e-6, 1.0).abs().max().item()
    diff = (out.float() - ref.float()).abs()
    same = (out == ref).float().mean().item()
    print(f"norm+rope talker shape: max |kernel - reference| {diff.max().item():.3g}, max |y| {y_max:.3g}, "
          f"{same:.4f} of elements identical")
    # The kernel's rsqrt and sum order differ from torch's by an fp32 ulp, which flips the bf16 rounding
    # of a normalised element now and then (~1 in 2^15): the flip (1 ulp of y) passes through cos and sin
    # and each of the three bf16 roundings after it can add an ulp, so at most 5 bf16 ulps of max |y|.
    assert diff.max().item() <= 5 * 2 ** -8 * y_max
    assert same > 0.98


# ---- add_rms_norm: the joint between two pre-normed blocks ------------------------------------------------

@pytest.mark.parametrize("width,offset,norm_delta", [(48, 0.0, False),   # Nemotron-H: s = x + block(x')
                                                     (40, 1.0, True),    # Gemma: s = x + post_norm(block(x'))
                                                     (100, 1.0, True)])  # a width that is not a power of two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_the_two_ops(width, offset, norm_delta, dtype):
    """(s, y) against the reference (the ops the models ran before) and float64. fp32: within 2e-6 of the
    reference (reduction order). bf16: the residual stream s is the add of two bf16 values rounded once,
    so it must be identical where d is identical (always without the post-norm; with it, >= 95% of d
    bit-identical as for rms_norm); y within one bf16 step and >= 95% bit-identical."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(6, width, generator=gen).to(DEVICE, dtype)
    delta = (torch.randn(6, width, generator=gen) * 3).to(DEVICE, dtype)
    w = (torch.randn(width, generator=gen) * 0.2).to(DEVICE, dtype)
    dw = (torch.randn(width, generator=gen) * 0.2).to(DEVICE, dtype) if norm_delta else None
    s, y = add_rms_norm_triton(x, delta, w, 1e-6, offset, dw, 1e-5)
    s_ref, y_ref = add_rms_norm_reference(x, delta, w, 1e-6, offset, dw, 1e-5)
    d64 = delta.double() if dw is None else _float64(delta, dw, 1e-5, offset)
    assert s.dtype == y.dtype == dtype and s.shape == y.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(s, s_ref, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(y, y_ref, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(s.double(), x.double() + d64, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y.double(), _float64(s, w, 1e-6, offset), rtol=1e-5, atol=1e-5)
    else:
        if dw is None:
            assert torch.equal(s, s_ref)
        assert (s == s_ref).float().mean() > 0.95 and (y == y_ref).float().mean() > 0.95
        torch.testing.assert_close(s.float(), s_ref.float(), rtol=2 ** -7, atol=2 ** -7)
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=2 ** -7, atol=2 ** -7)
    # the dispatch takes the kernel here (interpreter / CUDA) and gives the same values
    s2, y2 = add_rms_norm(x, delta, w, 1e-6, offset, dw, 1e-5)
    assert torch.equal(s2, s) and torch.equal(y2, y)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width,offset,norm_delta", [(128, 4480, 0.0, False), (256, 1152, 1.0, True)])
def test_gpu_add_rms_norm_full_shapes(rows, width, offset, norm_delta):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(rows, width, device="cuda", generator=gen, dtype=torch.bfloat16)
    delta = torch.randn(rows, width, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(width, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.2
    dw = torch.randn(width, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.2 if norm_delta else None
    s, y = add_rms_norm(x, delta, w, 1e-6, offset, dw)
    s_ref, y_ref = add_rms_norm_reference(x, delta, w, 1e-6, offset, dw)
    for out, ref in ((s, s_ref), (y, y_ref)):
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=2 ** -7)
        assert (out == ref).float().mean() > 0.95


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_store_into_pages(dtype):
    """The store with a page table (ops/kv_pages.py): every row's positions, gathered back through the table,
    equal what the unpaged store writes, bit for bit, and the pages no row owns are untouched; the torch
    statements (the CPU path) write the same places."""
    from ops.kv_pages import kv_gather
    from ops.rmsnorm import rms_norm_rope_store_reference, rms_norm_rope_store_triton
    from tests.ops.support import paginate
    gen = torch.Generator().manual_seed(12)
    k, w, cos, sin, v, pool_k, pool_v, rows, positions = _kv_store_inputs(gen, 4, 3, 18, 7, 11, dtype, DEVICE)
    (paged_k, paged_v), pages = paginate((pool_k, pool_v), 4, gen)
    owned = torch.zeros(paged_k.shape[0], dtype=torch.bool, device=DEVICE)
    owned[pages.flatten().long()] = True
    spare_k = paged_k[~owned].clone()
    ref_k, ref_v = paged_k.clone(), paged_v.clone()
    rms_norm_rope_store_triton(k, w, 1e-6, cos, sin, v, pool_k, pool_v, rows, positions)
    rms_norm_rope_store_triton(k, w, 1e-6, cos, sin, v, paged_k, paged_v, rows, positions, pages=pages)
    rms_norm_rope_store_reference(k, w, 1e-6, cos, sin, v, ref_k, ref_v, rows, positions, pages=pages)
    every = torch.arange(pool_k.shape[0], device=DEVICE)
    assert torch.equal(kv_gather(paged_k, pages, every)[:, :, :11], pool_k)
    assert torch.equal(kv_gather(paged_v, pages, every)[:, :, :11], pool_v)
    assert torch.equal(paged_k[~owned], spare_k)
    assert torch.equal(ref_v, paged_v)
    tolerance = 4 * 2 ** -8 * 8 if dtype == torch.bfloat16 else 2e-6
    torch.testing.assert_close(ref_k.float(), paged_k.float(), rtol=0, atol=tolerance)


@pytest.mark.parametrize("paged", [False, True])
def test_norm_rope_store_into_fp8_pools(paged):
    """`dtype.talker_kv: fp8`: the store computes k in the compute dtype exactly as it does for a pool of that
    dtype and only then casts to float8 e4m3, nearest and saturated (ops/kv_pages.py's to_pool): the fp8
    pools equal to_pool of the bf16 pools, bit for bit, over values that saturate (v up to ~2000) and values
    below e4m3's normals (2^-6); the torch statements do the same."""
    from ops.kv_pages import to_pool
    from ops.rmsnorm import rms_norm_rope_store_reference, rms_norm_rope_store_triton
    from tests.ops.support import paginate
    fp8 = torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(14)
    k, w, cos, sin, v, pool_k, pool_v, rows, positions = _kv_store_inputs(gen, 4, 3, 18, 7, 11, torch.bfloat16,
                                                                          DEVICE)
    v = (v.float() * torch.logspace(-4, 3.3, 18, device=DEVICE)).to(torch.bfloat16)   # 1e-4 .. 2000 per column
    assert v.float().abs().max() > 448 and (v.float().abs() < 2 ** -6).any()
    pages = None
    if paged:
        (pool_k, pool_v), pages = paginate((pool_k, pool_v), 4, gen)
    for store in (rms_norm_rope_store_triton, rms_norm_rope_store_reference):
        wide_k, wide_v = pool_k.clone(), pool_v.clone()
        narrow_k, narrow_v = to_pool(pool_k, fp8), to_pool(pool_v, fp8)
        store(k, w, 1e-6, cos, sin, v, wide_k, wide_v, rows, positions, pages=pages)
        store(k, w, 1e-6, cos, sin, v, narrow_k, narrow_v, rows, positions, pages=pages)
        assert narrow_k.dtype == fp8 and not narrow_v.float().isnan().any()
        assert torch.equal(narrow_k.view(torch.uint8), to_pool(wide_k, fp8).view(torch.uint8)), store.__name__
        assert torch.equal(narrow_v.view(torch.uint8), to_pool(wide_v, fp8).view(torch.uint8)), store.__name__
        assert narrow_v.float().abs().max() == 448.0


def test_to_pool_rounds_to_nearest_even_and_saturates():
    """to_pool's float8: the nearest e4m3 value, ties to even, +-448 past the range (no NaN)."""
    from ops.kv_pages import to_pool
    x = torch.tensor([31.5, -84.0, 1e4, -1e4, 2 ** -10, 3 * 2 ** -10, -0.0])
    got = to_pool(x, torch.float8_e4m3fn).float()
    assert got.tolist() == [32.0, -80.0, 448.0, -448.0, 0.0, 2 ** -8, -0.0]
