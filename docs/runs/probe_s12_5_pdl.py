"""session 12 probe: what programmatic dependent launch (PDL) saves per kernel boundary inside a CUDA graph,
for chains of small Triton kernels alone and alternating with cuBLAS(Lt) GEMMs (the step's pattern)."""
import statistics
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait, gdc_launch_dependents

torch.backends.cuda.preferred_blas_library("cublaslt")

@triton.jit
def scale_add(x_ptr, y_ptr, n, WAIT: tl.constexpr, TRIGGER: tl.constexpr, BLOCK: tl.constexpr):
    if WAIT:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m).to(tl.float32)
    tl.store(y_ptr + offs, (x * 1.0001 + 0.5).to(tl.bfloat16), mask=m)

def launch(x, y, mode):
    n = x.numel()
    BLOCK = 4096
    wait, trig, pdl = {"plain": (False, False, False), "pdl": (True, False, True), "pdl+trigger": (True, True, True)}[mode]
    scale_add[(triton.cdiv(n, BLOCK),)](x, y, n, WAIT=wait, TRIGGER=trig, BLOCK=BLOCK, launch_pdl=pdl, num_warps=4)

def graph_time(fn, reps=5):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)

dev = "cuda"
for rows, width in ((32, 4480), (128, 4480), (32, 1024)):
    bufs = [torch.randn(rows, width, device=dev).to(torch.bfloat16) for _ in range(2)]
    K = 400
    res = {}
    for mode in ("plain", "pdl", "pdl+trigger"):
        def chain():
            for i in range(K):
                launch(bufs[i % 2], bufs[(i + 1) % 2], mode)
        res[mode] = graph_time(chain) / K
    print(f"{K} small kernels [{rows}x{width}] bf16: " + ", ".join(f"{m} {v:.2f} us" for m, v in res.items()), flush=True)
    # alternating with GEMMs: x [rows, width] @ W [width, width]^T, then the small kernel on the result
    for wn in (1024, 4480):
        W = torch.randn(wn, width, device=dev).to(torch.bfloat16) * 0.01
        xs = [torch.randn(rows, width, device=dev).to(torch.bfloat16) for _ in range(2)]
        out = torch.empty(rows, wn, device=dev, dtype=torch.bfloat16)
        res2 = {}
        for mode in ("plain", "pdl", "pdl+trigger"):
            def chain2():
                for i in range(100):
                    torch.mm(xs[i % 2], W.t(), out=out)
                    launch(out, xs[(i + 1) % 2][:, :wn] if wn == width else out, mode)
            res2[mode] = graph_time(chain2) / 100
        print(f"  GEMM [{rows}x{width}]x[{width}x{wn}] + small kernel: " + ", ".join(f"{m} {v:.2f} us" for m, v in res2.items()), flush=True)
    # correctness: the pdl chain computes what the plain one does
    a = torch.randn(rows, width, device=dev).to(torch.bfloat16); b = torch.empty_like(a)
    outs = {}
    for mode in ("plain", "pdl", "pdl+trigger"):
        x0 = a.clone(); x1 = b.clone()
        def c3():
            for i in range(50):
                launch([x0, x1][i % 2], [x0, x1][(i + 1) % 2], mode)
        graph_time(c3)
        outs[mode] = x0.clone()
    print("  same results:", all(torch.equal(outs["plain"], v) for v in outs.values()))
