"""session 12 probe: the talker's 31 RVQ distance GEMMs (r [M, 512] fp32 x book [1024, 512]^T + norms, alpha -2):
IEEE addmm (as served) against the 3xTF32 kernel with the weights split once (fp32_linear presplit) and the
fp16x3 kernel with both split beforehand; each chain of 31 captured in a CUDA graph."""
import statistics, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path.cwd()))
from ops.fp32_linear import fp32_linear, split_tf32
from ops.fp16x3_linear import fp16x3_linear, split_fp16_rows, split_fp16_weight

torch.backends.cuda.preferred_blas_library("cublaslt")
torch.backends.cuda.matmul.fp32_precision = "ieee"

def graph_time(fn):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)

dev = "cuda"
g = torch.Generator().manual_seed(0)
books = (torch.randn(31, 1024, 512, generator=g) * 512 ** -0.5).to(dev)
norms = books.pow(2).sum(-1)
tf32 = [split_tf32(-2 * b) for b in books]
f16 = [split_fp16_weight(-2 * b) for b in books]
for M in (32, 128):
    r = torch.randn(M, 512, generator=g).to(dev)
    ref = [torch.addmm(norms[q].double(), r.double(), books[q].double().T, alpha=-2) for q in range(31)]
    outs = {}
    def ieee():
        outs["ieee"] = [torch.addmm(norms[q], r, books[q].T, alpha=-2) for q in range(31)]
    def t3():
        outs["tf32x3w"] = [fp32_linear(r, tf32[q][0], norms[q], presplit=True, weight_lo=tf32[q][1]) for q in range(31)]
    rs = split_fp16_rows(r)
    def h3():
        outs["fp16x3 (x split once)"] = [fp16x3_linear(rs, f16[q], norms[q]) for q in range(31)]
    for name, fn in (("ieee", ieee), ("tf32x3w", t3), ("fp16x3 (x split once)", h3)):
        t = graph_time(fn)
        err = max(((o.double() - e).abs().max() / e.abs().max()).item() for o, e in zip(outs[name], ref))
        same = sum(int(torch.equal(o.argmin(-1), e.argmin(-1))) for o, e in zip(outs[name], ref))
        print(f"M={M}: {name:>22}: 31 GEMMs {t:7.1f} us ({t / 31:5.2f} per GEMM), max rel err {err:.1e}, argmin = float64's in {same}/31 books", flush=True)
