"""What the kernel tests share."""
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # where the kernel tests run (CPU: Triton's interpreter)
# torch.library.opcheck's checks for an opaque custom op: its schema, its fake (shape) implementation and
# AOT dispatch, which is what a compiled frame step relies on
OPCHECK_TESTS = ("test_schema", "test_faketensor", "test_aot_dispatch_static")


def assert_norm_output(out, ref, exact, dtype, bf16_exact_rtol=2 ** -7):
    """A normalising kernel's output against its torch reference (`ref`, the same roundings) and the
    computation written out in float64 (`exact`). fp32: within 1e-5 of both (the reduction order differs).
    bf16: within one bf16 step of the reference and >= 99% bit-identical to it (an fp32 ulp of difference
    flips a rounding now and then), and within `bf16_exact_rtol` of float64 (one bf16 rounding, or more for
    kernels with more roundings after the norm); 1e-5 absolute where the value cancels to near zero."""
    assert out.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-5)
        assert (out == ref).float().mean().item() >= 0.99
        torch.testing.assert_close(out.double(), exact, rtol=bf16_exact_rtol, atol=1e-5)



def paginate(pools: tuple[torch.Tensor, ...], page_len: int, gen: torch.Generator, spare: int = 3):
    """Contiguous pools [R, heads, L, D] (the K and V of one layer) as paged ones (ops/kv_pages.py): each
    row cut into pages of page_len positions, the pages shuffled into pools with `spare` pages of noise
    besides, and the one table that finds them again. Returns (paged pools, pages [R, ceil(L / page_len)]
    int32); the positions past L of a row's last page are noise."""
    rows, heads, length, d = pools[0].shape
    per_row = -(-length // page_len)
    total = rows * per_row + spare
    order = torch.randperm(total, generator=gen)[: rows * per_row]
    paged = []
    for pool in pools:
        padded = torch.randn(rows, heads, per_row * page_len, d, generator=gen).to(pool.device, pool.dtype)
        padded[:, :, :length] = pool
        blocks = padded.unflatten(2, (per_row, page_len)).permute(0, 2, 1, 3, 4).flatten(0, 1)
        out = torch.randn(total, heads, page_len, d, generator=gen).to(pool.device, pool.dtype)
        out[order.to(pool.device)] = blocks
        paged.append(out)
    return tuple(paged), order.view(rows, per_row).to(torch.int32).to(pools[0].device)
