"""session 17 probe: the codec's fp16x3 GEMMs, one tiling per shape instead of one for all.

The codec's fp32-accurate GEMMs are 1.63 ms of N=32's step and 5.61 ms of N=128's (session 12's profile), at
about 375 / 435 TFLOP/s of fp16 tensor-core work (three products per fp32 one), against ~800 for a large cuBLAS
GEMM. Every shape runs with one tiling (ops/fp16x3_linear.py TILES = 128 x 128, 8 warps, 3 stages) and a split-K
picked from the tile count. The shapes are very unlike: 32 to 14112 rows, K from 384 to 6144. So this times,
per shape and flags exactly as `ConvNeXtBlock.step` / `Latent2Wav.step` call them, at N = 32 and 128 calls:

* the served launch (TILES, split-K by `pick_split_k`);
* a grid of tilings x split counts (same kernel, same per-64-column-block sums: a tiling changes no product,
  split-K only the order the block sums are added in);
* cuBLAS: three plain fp16 GEMMs of the shape (no scales, no block sums, fp16 out): the rate a GEMM library
  gets from these shapes, a ceiling, not an fp32-accurate GEMM.

Each timing is a CUDA graph of 10 launches replayed (median of 5 replays, after 2), weights and inputs random
(speed does not depend on the values); every variant's output is compared with the served launch's.

    python3 docs/runs/probe_s17_1_fp16x3_tiles.py warm I N   # compile the I-th of N parts (processes in parallel)
    python3 docs/runs/probe_s17_1_fp16x3_tiles.py time       # time everything (one process), JSON to $OUT
"""
import itertools
import json
import os
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, ".")
from ops import sm_count  # noqa: E402
from ops.fp16x3_linear import (SCALE_BLOCK, TILES, fp16x3_linear_triton, split_fp16_rows_triton,  # noqa: E402
                               split_fp16_weight)
from ops.fp32_linear import pick_split_k  # noqa: E402

dev = torch.device("cuda")
# (name, rows per call, K, N, flags, uses per step): the decoder at rates 9, 7, 7, widths 1536, 768, 384
SHAPES = [
    ("up1", 1, 512, 13824, {}, 1),
    ("s1.pw1", 9, 1536, 6144, {"gelu": True, "split_out": True, "bias": True}, 3),
    ("s1.pw2", 9, 6144, 1536, {"residual": True, "bias": True}, 3),
    ("up2", 9, 1536, 5376, {}, 1),
    ("s2.pw1", 63, 768, 3072, {"gelu": True, "split_out": True, "bias": True}, 3),
    ("s2.pw2", 63, 3072, 768, {"residual": True, "bias": True}, 3),
    ("up3", 63, 768, 2688, {}, 1),
    ("s3.pw1", 441, 384, 1536, {"gelu": True, "split_out": True, "bias": True}, 3),
    ("s3.pw2", 441, 1536, 384, {"residual": True, "bias": True}, 3),
    ("final", 441, 384, 18, {}, 1),
]
CALLS = (32, 128)
# (BLOCK_M, BLOCK_N, warps, stages); shared memory per stage is (BLOCK_M + BLOCK_N) x 64 x 4 bytes
TILINGS = [(128, 128, 8, 3), (128, 128, 4, 3), (128, 128, 8, 4), (128, 64, 4, 3), (128, 64, 4, 4),
           (64, 128, 4, 3), (64, 128, 4, 4), (64, 64, 4, 4), (256, 128, 8, 2), (128, 256, 8, 2),
           (64, 256, 8, 3), (256, 64, 8, 3), (32, 128, 4, 4), (32, 64, 4, 4)]
SPLITS = (1, 2, 3, 4, 6)


def cases():
    """Every (shape, calls, tiling, split) to run, the served launch first for each (shape, calls)."""
    out = []
    for (name, per_call, k, n, flags, uses), calls in itertools.product(SHAPES, CALLS):
        m = per_call * calls
        k_blocks = triton.cdiv(k, SCALE_BLOCK)
        if flags.get("split_out") and n % 64:
            continue
        out.append((name, calls, TILES, None))
        for tiling, split in itertools.product(TILINGS, SPLITS):
            if k_blocks % split or (split > 1 and split * m * n >= 2 ** 31):
                continue
            tiles = triton.cdiv(m, tiling[0]) * triton.cdiv(n, tiling[1])
            if split > 1 and tiles > 2 * 132:   # many waves already: a split only adds traffic
                continue
            if flags.get("split_out") and tiling[1] % SCALE_BLOCK:
                continue
            out.append((name, calls, tiling, split))
    return out


_data = {}


def data(name, calls):
    key = (name, calls)
    if key not in _data:
        _, per_call, k, n, flags, _ = next(s for s in SHAPES if s[0] == name)
        m = per_call * calls
        g = torch.Generator(device=dev).manual_seed(hash(key) % 2 ** 31)
        x = torch.randn(m, k, device=dev, generator=g)
        w = torch.randn(n, k, device=dev, generator=g) * k ** -0.5
        b = torch.randn(n, device=dev, generator=g) if flags.get("bias") else None
        r = torch.randn(m, n, device=dev, generator=g) if flags.get("residual") else None
        _data[key] = (split_fp16_rows_triton(x), split_fp16_weight(w), b, r, flags, (m, k, n), x, w)
    return _data[key]


def launch(name, calls, tiling, split):
    xs, ws, b, r, flags, *_ = data(name, calls)
    return fp16x3_linear_triton(xs, ws, b, gelu=flags.get("gelu", False), residual=r,
                                split_out=flags.get("split_out", False), tiles=tiling, split_k=split)


def graph_ms(fn, reps=10):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            out = fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            out = fn()
    times = []
    for i in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / reps)
    return statistics.median(times), out


def as_fp32(out):
    if isinstance(out, torch.Tensor):
        return out
    inv = out.inv.repeat_interleave(SCALE_BLOCK, 1)[:, :out.hi.shape[1]]
    return (out.hi.float() + out.lo.float()) * inv


def main():
    mode = sys.argv[1]
    todo = cases()
    if mode == "warm":
        part, parts = int(sys.argv[2]), int(sys.argv[3])
        for i, c in enumerate(todo):
            if i % parts == part:
                try:
                    launch(*c)
                except Exception as e:  # a tiling that does not fit (shared memory): the time pass skips it
                    print(f"warm {c}: {type(e).__name__}", flush=True)
        torch.cuda.synchronize()
        return
    print(f"{len(todo)} launches; SMs {sm_count(dev)}; served tiling {TILES}", flush=True)
    results = []
    served = {}
    t0 = time.time()
    for name, calls, tiling, split in todo:
        try:
            ms, out = graph_ms(lambda: launch(name, calls, tiling, split))
        except Exception as e:
            print(f"skip {name} N={calls} {tiling} s{split}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        y = as_fp32(out)
        key = (name, calls)
        if split is None:
            served[key] = (ms, y.clone())
            _, _, _, _, _, (m, k, n), _, _ = data(name, calls)
            split_used = pick_split_k(triton.cdiv(m, TILES[0]) * triton.cdiv(n, TILES[1]), k, SCALE_BLOCK, sm_count(dev))
            diff = 0.0
        else:
            split_used = split
            ref = served[key][1]
            diff = ((y - ref).abs().max() / ref.abs().max()).item()
        results.append(dict(shape=name, calls=calls, tiling=list(tiling), split=split_used,
                            served=split is None, ms=ms, rel_diff_vs_served=diff))
    print(f"timed in {time.time() - t0:.0f} s", flush=True)
    # cuBLAS: three fp16 GEMMs per shape (a ceiling)
    cublas = {}
    for (name, per_call, k, n, flags, uses), calls in itertools.product(SHAPES, CALLS):
        m = per_call * calls
        a = torch.randn(m, k, device=dev).half()
        w = torch.randn(n, k, device=dev).half()
        ms, _ = graph_ms(lambda: [torch.mm(a, w.t()) for _ in range(3)][-1])
        cublas[(name, calls)] = ms
    uses = {s[0]: s[5] for s in SHAPES}
    flops = {s[0]: 2 * s[1] * s[2] * s[3] for s in SHAPES}
    summary = {}
    for calls in CALLS:
        print(f"\n== N={calls} calls ==")
        print(f"{'shape':8} {'M':>6} {'served ms':>10} {'best ms':>9} {'best tiling, split':>26} "
              f"{'cuBLAS 3x fp16':>14} {'TFLOP/s best':>12} {'diff':>8}")
        tot = dict(served=0.0, best=0.0, cublas=0.0)
        for name, per_call, k, n, flags, u in SHAPES:
            rows = [r for r in results if r["shape"] == name and r["calls"] == calls]
            if not rows:
                continue
            s = next(r for r in rows if r["served"])
            best = min(rows, key=lambda r: r["ms"])
            cb = cublas[(name, calls)]
            tflops = 3 * flops[name] * calls / best["ms"] * 1e-9
            print(f"{name:8} {per_call * calls:6d} {s['ms']:10.4f} {best['ms']:9.4f} "
                  f"{str(best['tiling']) + ' s' + str(best['split']):>26} {cb:14.4f} {tflops:12.0f} "
                  f"{best['rel_diff_vs_served']:8.1e}")
            tot["served"] += u * s["ms"]
            tot["best"] += u * best["ms"]
            tot["cublas"] += u * cb
        print(f"per step (uses counted): served {tot['served']:.3f} ms, best per shape {tot['best']:.3f} ms, "
              f"cuBLAS 3x fp16 {tot['cublas']:.3f} ms")
        summary[calls] = tot
    out_dir = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out_dir, "probe_s17_1_fp16x3_tiles.json"), "w") as f:
        json.dump(dict(results=results, cublas={f"{k[0]}@{k[1]}": v for k, v in cublas.items()},
                       summary=summary), f, indent=1)


if __name__ == "__main__":
    main()
