"""session 15 probe: the encoder's and talker's small GEMMs, cuBLASLt against split-K Triton kernels.

Probe 1 of this session (probe_s15_1_l2_prefetch.py) found that the encoder's chain of 192 GEMMs at 32 rows
takes ~6 us per GEMM and only 3% less with every weight already in L2: the time is not DRAM, it is each
kernel's own latency. A GEMM of [32 x 4096] by a [1024 x 4096] weight in 64-column tiles is 16 programs on
132 SMs, each streaming 512 KB alone. So this times, per shape, at the step's rows, each in a CUDA graph
that runs 8 GEMMs of the shape on 8 different weights in a chain (each GEMM's input is the previous output,
cut or tiled to K):

* cuBLASLt (`F.linear`, as served: the step runs with `preferred_blas_library("cublaslt")`);
* `skinny`: ops/skinny_gemm.py (split-K; the fp32 partials summed by a second kernel in a fixed order);
* `serial`: one kernel, "swap AB" (acc^T [BLOCK_N, M] = W tile @ x^T, so the weight rows fill the MMA's
  M side), split-K whose last-arriving program per column block sums the partials in split order (an
  atomic ticket per block, reset by that program for the next replay): deterministic, one launch.

Every result is checked against an fp32 reference (max |diff| / max |ref|).

    python3 docs/runs/probe_s15_2_small_gemm.py            # on the device
    TRITON_INTERPRET=1 python docs/runs/probe_s15_2_small_gemm.py small   # the arithmetic on a CPU
"""
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, ".")
from ops.rmsnorm import _round_to  # noqa: E402
from ops.skinny_gemm import skinny_gemm_triton  # noqa: E402

SMALL = len(sys.argv) > 1 and sys.argv[1] == "small"
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@triton.jit
def _serial_splitk_kernel(x_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K, k_per_split, stride_xm,
                          SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in tl.range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :],
                    mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)           # [BLOCK_N, BLOCK_K]
        xt = tl.load(x_ptr + rows[None, :] * stride_xm + ks[:, None],
                     mask=(rows[None, :] < M) & (ks[:, None] < K), other=0.0)          # [BLOCK_K, BLOCK_M]
        if UPCAST:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    out_mask = (cols[:, None] < N) & (rows[None, :] < M)
    y_offs = rows[None, :] * N + cols[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptr + y_offs, _round_to(acc, tl.bfloat16, True).to(tl.bfloat16), mask=out_mask)
    else:
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + rows[None, :]
        base = part_ptr + pid_n * SPLIT_K * BLOCK_N * BLOCK_M
        tl.store(base + split * BLOCK_N * BLOCK_M + tile, acc)
        ticket = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:   # the last of this block's programs: every partial is written
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):   # split order, whoever arrived last: the sum is deterministic
                total += tl.load(base + s * BLOCK_N * BLOCK_M + tile, cache_modifier=".cg")
            tl.store(y_ptr + y_offs, _round_to(total, tl.bfloat16, True).to(tl.bfloat16), mask=out_mask)
            tl.atomic_xchg(ticket_ptr + pid_n, 0)


class Serial:
    def __init__(self, weight, m, block_n, block_k, split, warps, stages):
        self.w, self.m, self.bn, self.bk, self.warps, self.stages = weight, m, block_n, block_k, warps, stages
        n, k = weight.shape
        self.n_blocks = triton.cdiv(n, block_n)
        self.kps = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
        self.split = triton.cdiv(k, self.kps)
        self.block_m = max(16, triton.next_power_of_2(m))
        self.part = torch.empty(self.n_blocks * self.split * block_n * self.block_m, device=weight.device)
        self.ticket = torch.zeros(self.n_blocks, device=weight.device, dtype=torch.int32)

    def __call__(self, x):
        n, k = self.w.shape
        y = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
        _serial_splitk_kernel[(self.n_blocks, self.split)](
            x, self.w, y, self.part, self.ticket, x.shape[0], n, k, self.kps, x.stride(0), SPLIT_K=self.split,
            BLOCK_M=self.block_m, BLOCK_N=self.bn, BLOCK_K=self.bk, UPCAST=dev.type != "cuda",
            num_warps=self.warps, num_stages=self.stages)
        return y


def to_k(y, k):
    return y[:, :k] if y.shape[1] >= k else y.repeat(1, triton.cdiv(k, y.shape[1]))[:, :k]


def chain(x, fns, k):
    for f in fns:
        x = f(to_k(x, k))
    return x


def reference(x, weights, k):
    x = x.float()
    for w in weights:
        x = (to_k(x, k).to(w.dtype).float() @ w.float().t()).to(w.dtype).float()
    return x


def graph_us(fn, per, replays=20):
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
    return statistics.median(times) * 1e3 / per, out


def main():
    torch.manual_seed(0)
    if dev.type == "cuda":
        torch.backends.cuda.preferred_blas_library("cublaslt")
        sms = torch.cuda.get_device_properties(0).multi_processor_count
    else:
        sms = 4
    dtype = torch.bfloat16
    # (part, rows, K, N, uses per step)
    shapes = [("encoder", 32, 1024, 4096, 48), ("encoder", 32, 4096, 1024, 48), ("encoder", 32, 1024, 3072, 24),
              ("encoder", 32, 1024, 1024, 48), ("encoder", 32, 1024, 2048, 24),
              ("talker", 64, 1152, 3456, 28), ("talker", 64, 1152, 1152, 28), ("talker", 64, 1152, 9216, 28),
              ("talker", 64, 4608, 1152, 28)]
    block_ns, block_ks, stages = (32, 64, 128), (128, 256), (3, 4)
    if SMALL:
        shapes = [("small", 5, 96, 80, 1), ("small", 16, 256, 64, 1)]
        block_ns, block_ks, stages = (32,), (32,), (1,)
    reps = 8
    saved_total = 0.0
    for part, m, k, n, uses in shapes:
        weights = [torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5 for _ in range(reps)]
        x = torch.randn(m, k, device=dev, dtype=dtype)
        ref = reference(x, weights, k)
        scale = ref.abs().max().item()
        mb = n * k * 2 / 1e6

        def err(out):
            return (out.float() - ref).abs().max().item() / scale

        t_blas, out = graph_us(lambda: chain(x, [lambda a, w=w: F.linear(a, w) for w in weights], k), reps)
        print(f"== {part} [{m} x {k}] -> {n} ({mb:.1f} MB, x{uses} per step): cuBLASLt {t_blas:6.2f} us "
              f"({mb / t_blas * 1e3:5.0f} GB/s) err {err(out):.1e}", flush=True)
        results = []
        for bn in block_ns:
            blocks = triton.cdiv(n, bn)
            splits = sorted({max(1, min(k // 128, round(f * sms / blocks))) for f in (1, 2)})
            for bk in block_ks:
                for st in stages:
                    for sp in splits:
                        cfg = (bn, bk, 4, st)
                        try:
                            t_sk, out_sk = graph_us(lambda: chain(x, [lambda a, w=w: skinny_gemm_triton(
                                a, w, tiles=cfg, split_k=sp) for w in weights], k), reps)
                            results.append((t_sk, "skinny", cfg, sp, err(out_sk)))
                        except Exception as e:   # noqa: BLE001 (a tiling that does not fit: skip it)
                            print(f"   skinny {cfg} split {sp}: {type(e).__name__}")
                        try:
                            fns = [Serial(w, m, bn, bk, sp, 4, st) for w in weights]
                            t_se, out_se = graph_us(lambda: chain(x, fns, k), reps)
                            # the ticket reset: a second replay must give the same bits
                            again = chain(x, fns, k)
                            results.append((t_se, "serial", cfg, sp, err(out_se), torch.equal(again, out_se)))
                        except Exception as e:   # noqa: BLE001
                            print(f"   serial {cfg} split {sp}: {type(e).__name__}: {str(e)[:120]}")
        results.sort(key=lambda r: (r[0] if r[0] == r[0] else 0))
        for kind in ("skinny", "serial"):
            best = [r for r in results if r[1] == kind][:3]
            for r in best:
                extra = f" repeat-exact {r[5]}" if len(r) > 5 else ""
                print(f"   {kind:6s} {r[0]:6.2f} us  tiles (BN, BK, warps, stages) {r[2]} split {r[3]}  "
                      f"err {r[4]:.1e}{extra}", flush=True)
        if results and dev.type == "cuda":
            best = results[0][0]
            saved_total += max(0.0, t_blas - best) * uses
    print(f"best-of per shape against cuBLASLt, summed over the step's uses: {saved_total:.0f} us saved")


if __name__ == "__main__":
    main()
