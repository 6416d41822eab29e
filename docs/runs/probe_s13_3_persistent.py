"""session 13 probe: is a grid barrier inside one persistent kernel cheaper than a kernel boundary in a graph?

Session 12's plan for N=32 at 1.5x its floor was to run the small parts' layers (encoder, talker backbone,
MoG trunk) as persistent kernels with a grid barrier between phases. This measures the premise on a chain of
P dependent GEMM phases at the encoder's shapes: y_p = x_p @ W_p^T, x_p [32, 1024] bf16 (the first 1024
columns of y_{p-1}), W_p [4096, 1024] (8 MiB each, P of them: more than the L2 holds), 128 programs of 32
output columns each. Four ways, each captured in a CUDA graph and replayed:
  - separate: one Triton launch per phase (the step's pattern today, GEMM by GEMM);
  - persistent: ONE cooperative launch (every program resident) running all P phases, an atomic-counter grid
    barrier between them (release/acquire at GPU scope);
  - persistent-nobarrier: the same kernel without the barriers (wrong results: a lower bound for the loop);
  - persistent-prefetch: with the barriers, and between arriving and waiting each program reads its next
    phase's weights once (summed into a sink so the loads stay), so the next phase finds them in the L2;
  - cuBLASLt: torch's GEMM per phase.
Each result is checked against a float32 chain. Prints us per phase and the weight stream rate.

    python3 docs/runs/probe_s13_3_persistent.py     # on the device (Triton 3.6)
    python3 docs/runs/probe_s13_3_persistent.py 256,4,4 1024,1,8 ...   # other K blocks / stages / warps
"""
import statistics

import torch
import triton
import triton.language as tl

BM, BN, BK, K, N = 32, 32, 128, 1024, 4096


@triton.jit
def _phase(x_ptr, w_ptr, y_ptr, pid, K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
           BK: tl.constexpr):
    rows = tl.arange(0, BM)
    cols = pid * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * N + ks[None, :], cache_modifier=".cg")  # written by other programs
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :])
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16))


@triton.jit
def phase_kernel(x_ptr, w_ptr, y_ptr, K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
    _phase(x_ptr, w_ptr, y_ptr, tl.program_id(0), K, N, BM, BN, BK)


@triton.jit
def persistent_kernel(buf_ptr, w_ptr, counter_ptr, sink_ptr, P: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BARRIER: tl.constexpr,
                      PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for p in range(P):
        _phase(buf_ptr + p * BM * N, w_ptr + p * N * K, buf_ptr + (p + 1) * BM * N, pid, K, N, BM, BN, BK)
        if BARRIER:
            tl.debug_barrier()  # every warp of this program has stored its part
            tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")  # arrive
            if PREFETCH:  # between arriving and waiting: pull this program's next weights into the L2
                if p + 1 < P:
                    cols = pid * BN + tl.arange(0, BN)
                    touched = tl.zeros((BN, BK), tl.float32)
                    for k0 in range(0, K, BK):
                        ks = k0 + tl.arange(0, BK)
                        touched += tl.load(w_ptr + (p + 1) * N * K + cols[:, None] * K + ks[None, :]).to(tl.float32)
                    tl.store(sink_ptr + pid, tl.sum(touched))  # keeps the loads
            target = (p + 1) * nprog
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
            while seen < target:
                seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()


def graph_us(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def main(BK=BK, STAGES=4, WARPS=4, variants=None):
    dev = "cuda"
    torch.backends.cuda.preferred_blas_library("cublaslt")
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    for P in (8, 24):
        g = torch.Generator().manual_seed(P)
        w = (torch.randn(P, N, K, generator=g) * K ** -0.5).to(dev, torch.bfloat16)
        buf = torch.zeros(P + 1, BM, N, device=dev, dtype=torch.bfloat16)
        buf[0, :, :K] = torch.randn(BM, K, generator=g).to(dev, torch.bfloat16)
        counter = torch.zeros(1, device=dev, dtype=torch.int32)
        ref = buf[0, :, :K].float()
        for p in range(P):  # fp32 chain on the bf16-rounded intermediates, as the kernels round them
            ref = (ref @ w[p].float().T).to(torch.bfloat16).float()
            ref_p = ref
            ref = ref[:, :K]

        def separate():
            for p in range(P):
                phase_kernel[(N // BN,)](buf[p], w[p], buf[p + 1], K, N, BM, BN, BK, num_warps=WARPS, num_stages=STAGES)

        sink = torch.zeros(N // BN, device=dev)

        def persistent(barrier=True, prefetch=False):
            counter.zero_()
            persistent_kernel[(N // BN,)](buf, w, counter, sink, P, K, N, BM, BN, BK, barrier, prefetch, num_warps=WARPS,
                                          num_stages=STAGES, launch_cooperative_grid=True)

        outs = [torch.empty(BM, N, device=dev, dtype=torch.bfloat16) for _ in range(P)]

        def cublaslt():
            x = buf[0, :, :K]
            for p in range(P):
                torch.mm(x, w[p].T, out=outs[p])
                x = outs[p][:, :K]

        mb = P * N * K * 2 / 1e6
        for name, fn, result in (("separate", separate, lambda: buf[P]), ("persistent", persistent, lambda: buf[P]),
                                 ("persistent-nobarrier", lambda: persistent(False), lambda: buf[P]),
                                 ("persistent-prefetch", lambda: persistent(True, True), lambda: buf[P]),
                                 ("cuBLASLt", cublaslt, lambda: outs[P - 1])):
            if variants and name not in variants:
                continue
            buf[1:].zero_()
            try:
                fn()
                torch.cuda.synchronize()
                err = ((result().float() - ref_p).norm() / ref_p.norm()).item()
                us = graph_us(fn)
                print(f"BK={BK} stages={STAGES} warps={WARPS} P={P:2d} {name:>21}: {us:8.1f} us, {us / P:6.2f} us per phase, {mb / us:5.2f} TB/s of "
                      f"weights, rel err vs fp32 chain {err:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001 - a probe: report and go on
                print(f"BK={BK} stages={STAGES} warps={WARPS} P={P:2d} {name:>21}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    import sys
    if len(sys.argv) > 1:  # "BK,stages,warps" ...: the tilings to try (separate, persistent, no barrier)
        for spec in sys.argv[1:]:
            bk, stages, warps = map(int, spec.split(","))
            main(bk, stages, warps, variants=("separate", "persistent", "persistent-nobarrier"))
    else:
        main()
