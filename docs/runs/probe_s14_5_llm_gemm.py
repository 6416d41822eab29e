"""session 14 probe: can a Triton GEMM stream the LLM's weights at 32 rows faster than cuBLASLt?

At N=32 the LLM's bf16 GEMMs are the step's largest block of time (~4.9 ms of the 7.7 ms of GEMMs in the
session 12 profile) at ~3.4-3.5 TB/s of weights, against 4.2 TB/s for a copy. This times the LLM's GEMM shapes
at 32 rows, each way captured in a CUDA graph that runs 8 GEMMs of the shape on 8 different weights (more
bytes than the L2), and checks each against an fp32 reference:

* cuBLASLt (`F.linear`, as served);
* a Triton kernel whose weight tiles come in through TMA (host `TensorDescriptor`, Triton 3.6), "swap AB":
  acc^T [BLOCK_N, 32] = W tile [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, 32], so the weight rows fill the MMA's
  M side; with `split` > 1 each program takes a K slice and the fp32 partials are summed by torch (timed
  with it).

    python3 docs/runs/probe_s14_5_llm_gemm.py            # on the device
    TRITON_INTERPRET=1 python docs/runs/probe_s14_5_llm_gemm.py small   # the arithmetic, on a CPU
"""
import itertools
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

SMALL = len(sys.argv) > 1 and sys.argv[1] == "small"
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
M = 32
# (name, K, N, uses per step) -- the LLM's GEMMs (docs/runs/bench_ops_2026-11-29_s4_3_skinny.log)
SHAPES = [("mamba in_proj", 4480, 22656, 27), ("mamba out_proj", 10240, 4480, 27),
          ("mlp up", 4480, 15680, 25), ("mlp down", 15680, 4480, 25)]
if SMALL:
    SHAPES = [("small a", 256, 384, 1), ("small b", 480, 128, 1)]   # 480: K not a whole number of blocks


@triton.jit
def _tma_swap_ab_kernel(w_desc, x_ptr, out_ptr, K, N, k_per_split,
                        M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k_start = split * k_per_split
    acc = tl.zeros((BLOCK_N, M), dtype=tl.float32)
    rows = tl.arange(0, M)
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in tl.range(k_start, k_end, BLOCK_K):
        w = w_desc.load([n0, k0])                 # [BLOCK_N, BLOCK_K] bf16; TMA fills past K with zeros
        ks = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + rows[None, :] * K + ks[:, None], mask=ks[:, None] < K, other=0.0)  # [BLOCK_K, M]
        if UPCAST:  # the CPU check: this machine's interpreter (Triton 3.9) returns garbage from bf16 dots
            w, xt = w.to(tl.float32), xt.to(tl.float32)
        acc = tl.dot(w, xt, acc)
    cols = n0 + tl.arange(0, BLOCK_N)
    out = out_ptr + split * M * N + rows[None, :] * N + cols[:, None]  # out [split, M, N] fp32
    tl.store(out, acc, mask=cols[:, None] < N)


def tma_linear(x, w, block_n, block_k, stages, warps, split):
    k, n = w.shape[1], w.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k   # whole K blocks per split
    desc = TensorDescriptor.from_tensor(w, [block_n, block_k])
    part = torch.empty(split, x.shape[0], n, device=x.device, dtype=torch.float32)
    _tma_swap_ab_kernel[(triton.cdiv(n, block_n), split)](desc, x, part, k, n, k_per_split, M=x.shape[0],
                                                          BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=not x.is_cuda,
                                                          num_stages=stages, num_warps=warps)
    return (part[0] if split == 1 else part.sum(0)).to(torch.bfloat16)


def graph_time_us(fn, reps=8, replays=20):
    """fn(i) runs the i-th copy; the `reps` copies in one CUDA graph; -> us per copy (median of replays)."""
    if dev.type != "cuda":
        for i in range(reps):
            fn(i)
        return float("nan")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(reps):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return sorted(times)[len(times) // 2]


def main():
    if dev.type == "cuda":
        torch.backends.cuda.preferred_blas_library("cublaslt")
        print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    gen = torch.Generator(device="cpu").manual_seed(0)
    reps = 8 if dev.type == "cuda" else 1
    for name, k, n, uses in SHAPES:
        ws = [(torch.randn(n, k, generator=gen) * k ** -0.5).to(dev, torch.bfloat16) for _ in range(reps)]
        x = torch.randn(M, k, generator=gen).to(dev, torch.bfloat16)
        ref = x.double() @ ws[0].double().T
        scale = ref.abs().max().item()
        gb = n * k * 2 / 1e9
        t = graph_time_us(lambda i: F.linear(x, ws[i]), reps)
        err = (F.linear(x, ws[0]).double() - ref).abs().max().item() / scale
        print(f"{name:15s} [{M} x {k}] x [{k} x {n}] x{uses}: cuBLASLt {t:7.2f} us  {gb / t * 1e6:6.0f} GB/s  err {err:.1e}")
        best = None
        grid = ([(64, 64, 3, 4, 1), (128, 64, 3, 4, 2)] if SMALL else
                list(itertools.product((64, 128), (64, 128), (3, 5), (4,), (1, 2, 4))))
        for bn, bk, stages, warps, split in grid:
            try:
                out = tma_linear(x, ws[0], bn, bk, stages, warps, split)
                err = (out.double() - ref).abs().max().item() / scale
                t = graph_time_us(lambda i: tma_linear(x, ws[i], bn, bk, stages, warps, split), reps)
            except Exception as e:  # noqa: BLE001 (a tiling that does not fit: report and go on)
                print(f"    tma {bn}x{bk} s{stages} w{warps} split {split}: {type(e).__name__}: {str(e)[:80]}")
                continue
            line = f"    tma {bn:3d}x{bk:3d} s{stages} w{warps} split {split}: {t:7.2f} us  {gb / t * 1e6:6.0f} GB/s  err {err:.1e}"
            print(line)
            if best is None or t < best[0]:
                best = (t, line)
        if best is not None and dev.type == "cuda":
            print("  best" + best[1][3:])


if __name__ == "__main__":
    main()
