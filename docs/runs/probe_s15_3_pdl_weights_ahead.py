"""session 15 probe: a GEMM that loads its weights BEFORE it waits for its input (PDL, weights ahead).

Probes 1-2 of this session: the encoder's and talker's GEMMs at N=32 cost ~4.5-11 us each in a dependent
chain whatever the kernel, and only 3-12% less with the weights in L2: a kernel's own latency (launch, first
loads, drain), paid once per GEMM, ~300 times per step. Session 12's PDL probe (programmatic dependent launch)
had each kernel wait before its first load, which saves only the launch (0.1-0.3 us). The weights do not
depend on the previous kernel, so a GEMM launched early can have them in registers before it waits:

    gdc_launch_dependents()      # let the next kernel launch now (it will wait for us in its turn)
    w = load(this program's weight tile)      # overlaps the previous kernel
    gdc_wait()                   # the previous kernel's output is complete and visible
    x = load(input); acc = w @ x ...

The kernel (swap AB: acc^T [BLOCK_N, M] = W tile [BLOCK_N, KS] @ x^T [KS, M]) gives each program one
[64 x 256] weight tile (32 KB), so a GEMM of these sizes is 64-720 programs; the K slices are summed by the
last program of each column block in split order (atomic ticket, deterministic). A small "glue" kernel (SiLU)
sits between two GEMMs, as in the step. Chains as in probe 1 (encoder: 24 layers x 8 GEMMs at 32 rows;
talker: 28 x 4 at 64 rows; each GEMM on its own weight), each captured in one CUDA graph:

* `cublas`: cuBLASLt + glue (as served);
* `ours`: this kernel + glue, plain launches;
* `pdl wait-first`: both kernels PDL-launched, each waits before any load (session 12's way);
* `pdl weights-ahead`: the GEMM loads its weight tile before it waits.

Results are checked against an fp32 reference and the three `ours` ways against each other (same bits).

    python3 docs/runs/probe_s15_3_pdl_weights_ahead.py            # on the device
    TRITON_INTERPRET=1 python docs/runs/probe_s15_3_pdl_weights_ahead.py small   # the arithmetic (no PDL)
"""
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, ".")
from ops.rmsnorm import _round_to  # noqa: E402

SMALL = len(sys.argv) > 1 and sys.argv[1] == "small"
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if dev.type == "cuda":
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
else:  # the interpreter runs programs one after another: nothing to overlap
    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


@triton.jit
def _ahead_gemm_kernel(x_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K, stride_xm,
                       SPLIT_K: tl.constexpr, KS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PDL: tl.constexpr, AHEAD: tl.constexpr, UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = split * KS + tl.arange(0, KS)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :]
    w_mask = (cols[:, None] < N) & (ks[None, :] < K)
    if AHEAD:
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)                                   # [BLOCK_N, KS]
        if PDL:
            gdc_wait()
    else:
        if PDL:
            gdc_wait()
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    xt = tl.load(x_ptr + rows[None, :] * stride_xm + ks[:, None],
                 mask=(rows[None, :] < M) & (ks[:, None] < K), other=0.0)              # [KS, BLOCK_M]
    if UPCAST:
        acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(w, xt)
    out_mask = (cols[:, None] < N) & (rows[None, :] < M)
    y_offs = rows[None, :] * N + cols[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptr + y_offs, _round_to(acc, tl.bfloat16, True).to(tl.bfloat16), mask=out_mask)
    else:
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + rows[None, :]
        base = part_ptr + pid_n * SPLIT_K * BLOCK_N * BLOCK_M
        tl.store(base + split * BLOCK_N * BLOCK_M + tile, acc)
        ticket = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(base + s * BLOCK_N * BLOCK_M + tile, cache_modifier=".cg")
            tl.store(y_ptr + y_offs, _round_to(total, tl.bfloat16, True).to(tl.bfloat16), mask=out_mask)
            tl.atomic_xchg(ticket_ptr + pid_n, 0)


@triton.jit
def _glue_kernel(x_ptr, out_ptr, n_in, n_out, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[row, k] = rmsnorm(silu(x[row, k % n_in])) over k < n_out, rounded to bf16."""
    row = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    k = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_in + k % n_in, mask=k < n_out, other=0.0).to(tl.float32)
    y = x * tl.sigmoid(x)
    y = y / tl.sqrt(tl.sum(y * y) / n_out + 1e-6)   # an RMS norm, so 200 layers neither vanish nor blow up
    tl.store(out_ptr + row * n_out + k, _round_to(y, tl.bfloat16, True).to(tl.bfloat16), mask=k < n_out)


def glue(x, n_out, pdl):
    out = torch.empty(x.shape[0], n_out, device=x.device, dtype=x.dtype)
    kw = {"launch_pdl": True} if pdl else {}
    _glue_kernel[(x.shape[0],)](x, out, x.shape[1], n_out, BLOCK=triton.next_power_of_2(n_out), PDL=pdl,
                                num_warps=4, **kw)
    return out


class AheadGemm:
    def __init__(self, weight, m, block_n=64, ks=256, warps=4):
        self.w, self.bn, self.ks, self.warps = weight, block_n, ks, warps
        n, k = weight.shape
        self.blocks, self.split = triton.cdiv(n, block_n), triton.cdiv(k, ks)
        self.bm = max(16, triton.next_power_of_2(m))
        self.part = torch.empty(self.blocks * self.split * block_n * self.bm, device=weight.device)
        self.ticket = torch.zeros(self.blocks, device=weight.device, dtype=torch.int32)

    def __call__(self, x, pdl, ahead):
        n, k = self.w.shape
        y = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
        kw = {"launch_pdl": True} if pdl else {}
        _ahead_gemm_kernel[(self.blocks, self.split)](
            x, self.w, y, self.part, self.ticket, x.shape[0], n, k, x.stride(0), SPLIT_K=self.split, KS=self.ks,
            BLOCK_M=self.bm, BLOCK_N=self.bn, PDL=pdl, AHEAD=ahead, UPCAST=dev.type != "cuda",
            num_warps=self.warps, num_stages=1, **kw)
        return y


def chain_cublas(x, weights):
    for w in weights:
        x = F.linear(glue(x, w.shape[1], False), w)
    return x


def chain_ours(x, gemms, pdl, ahead):
    for g in gemms:
        x = g(glue(x, g.w.shape[1], pdl), pdl, ahead)
    return x


def reference(x, weights):
    x = x.float()
    for w in weights:
        xin = x[:, torch.arange(w.shape[1], device=x.device) % x.shape[1]]
        y = F.silu(xin)
        y = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        x = (y.to(w.dtype).float() @ w.float().t()).to(w.dtype).float()
    return x


def graph_us(fn, replays=20):
    if dev.type != "cuda":
        return float("nan"), fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times) * 1e3, out


def main():
    torch.manual_seed(0)
    if dev.type == "cuda":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    enc_layer = [(1024, 4096), (4096, 1024), (1024, 3072), (1024, 1024), (1024, 2048), (1024, 1024),
                 (1024, 4096), (4096, 1024)]
    talker_layer = [(1152, 3456), (1152, 1152), (1152, 9216), (4608, 1152)]
    # per shape (K, N): (BLOCK_N, KS, warps). "64x256": one tiling for all (32 KB of weight per program);
    # "per-shape": K whole in one program where K <= 1024 (no split, no ticket), else 512-wide K slices
    per_shape = {(1024, 4096): (16, 1024, 8), (4096, 1024): (32, 512, 8), (1024, 3072): (16, 1024, 8),
                 (1024, 1024): (16, 1024, 8), (1024, 2048): (16, 1024, 8), (1152, 3456): (16, 512, 8),
                 (1152, 1152): (16, 512, 8), (1152, 9216): (32, 512, 8), (4608, 1152): (32, 512, 8)}
    tilings = [("64x256", lambda k, n: (64, 256, 4)), ("per-shape", lambda k, n: per_shape[(k, n)])]
    parts = [("encoder", 32, 24, enc_layer), ("talker", 64, 28, talker_layer)]
    if SMALL:
        parts = [("small", 5, 2, [(96, 80), (80, 40)])]
        tilings = [("32x32", lambda k, n: (32, 32, 4)), ("16x64", lambda k, n: (16, 64, 4))]
    for name, rows, layers, layer in parts:
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
                   for _ in range(layers) for k, n in layer]
        x0 = torch.randn(rows, layer[0][0], device=dev, dtype=torch.bfloat16)
        ref = reference(x0, weights)
        scale = ref.abs().max().item()
        print(f"== {name}: {rows} rows, {layers} x {len(layer)} GEMMs", flush=True)
        us, out = graph_us(lambda: chain_cublas(x0, weights))
        print(f"  cublas {us:8.1f} us  ({us / len(weights):5.2f} per GEMM + glue)  "
              f"err {(out.float() - ref).abs().max().item() / scale:.1e}", flush=True)
        for tiling, pick in tilings:
            gemms = [AheadGemm(w, rows, *pick(w.shape[1], w.shape[0])) for w in weights]
            print(f"  tiling {tiling}: {[g.blocks * g.split for g in gemms[:len(layer)]]} programs", flush=True)
            runs = [("ours", lambda: chain_ours(x0, gemms, False, True)),
                    ("pdl wait-first", lambda: chain_ours(x0, gemms, dev.type == "cuda", False)),
                    ("pdl weights-ahead", lambda: chain_ours(x0, gemms, dev.type == "cuda", True))]
            outs = {}
            for label, fn in runs:
                try:
                    us, out = graph_us(fn)
                except Exception as e:  # noqa: BLE001 (a tiling that does not fit)
                    print(f"    {label}: {type(e).__name__}: {str(e)[:150]}", flush=True)
                    continue
                outs[label] = out
                err = (out.float() - ref).abs().max().item() / scale
                print(f"    {label:18s} {us:8.1f} us  ({us / len(weights):5.2f} per GEMM + glue)  err {err:.1e}",
                      flush=True)
            if len(outs) == 3:
                print("    ours / pdl ways same bits:", torch.equal(outs["ours"], outs["pdl wait-first"])
                      and torch.equal(outs["ours"], outs["pdl weights-ahead"]), flush=True)
        # the chain is chaotic over 100-200 layers in bf16 (any two kernels end far apart): check one GEMM
        g = AheadGemm(weights[0], rows, *tilings[-1][1](layer[0][0], layer[0][1]))
        one = g(x0, False, True).float()
        one_ref = x0.float() @ weights[0].float().t()
        print(f"  one GEMM against fp32: {(one - one_ref).abs().max().item() / one_ref.abs().max().item():.1e} "
              f"(cuBLASLt {(F.linear(x0, weights[0]).float() - one_ref).abs().max().item() / one_ref.abs().max().item():.1e})",
              flush=True)


if __name__ == "__main__":
    main()
