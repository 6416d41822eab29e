"""session 18 probe: the talker's RVQ (31 codebooks in passes of 1, 1, 3, 4, 22) as ops/rvq_quantise.py's k + 1
launches per pass against the served loop (per codebook: cuBLAS SGEMM distances with the norms as a 1-D bias, its
split-K reduction, ops/argmin_residual.py). Full shapes: 1024 codewords x 512, B = 32 and 128 rows (one per call).

Each variant runs the five passes as the step does, captured in a CUDA graph (10 steps per replay, median of 5
replays after 2); the codes are compared with the served loop's (count of differing codes).

    python3 docs/runs/probe_s18_2_rvq.py        # JSON to $OUT

ops/rvq_quantise.py was removed after this probe (slower than the served loop, docs/performance.md session 18):
run it from a checkout of commit 60e741c, which has the kernel.
"""
import itertools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, ".")
from ops.argmin_residual import argmin_residual  # noqa: E402
from ops.rvq_quantise import rvq_quantise_triton  # noqa: E402

dev = torch.device("cuda")
PASSES = (1, 1, 3, 4, 22)
Q, C, D = 31, 1024, 512


def served(z, books, norms):
    out, start = [], 0
    for p, size in enumerate(PASSES):
        r = z[p]
        codes = []
        for book, norm in zip(books[start:start + size], norms[start:start + size]):
            distances = torch.addmm(norm, r, book.T, alpha=-2)
            idx, r = argmin_residual(distances, r, book)
            codes.append(idx)
        out.append(torch.stack(codes, -1))
        start += size
    return torch.cat(out, -1)


def kernel(z, books, norms, tiles, precision):
    out, start = [], 0
    for p, size in enumerate(PASSES):
        out.append(rvq_quantise_triton(z[p], books[start:start + size], norms[start:start + size], tiles,
                                       precision))
        start += size
    return torch.cat(out, -1)


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


def main():
    g = torch.Generator(device=dev).manual_seed(18)
    books = torch.randn(Q, C, D, device=dev, generator=g) * D ** -0.5
    norms = books.pow(2).sum(-1)
    results = {}
    for batch in (32, 128):
        # one fresh z per pass, near a sum of the pass's codewords (as the MoG predicts) plus noise
        z = torch.randn(len(PASSES), batch, D, device=dev, generator=g) * 0.3
        ms, ref = graph_ms(lambda: served(z, books, norms))
        results[f"served@{batch}"] = dict(ms=ms, differing=0)
        print(f"B={batch:3d} served                      {ms * 1e3:8.1f} us per step", flush=True)
        for tiles, precision in itertools.product(
                [(32, 16, 64, 4), (16, 16, 64, 4), (32, 16, 128, 4), (32, 16, 64, 8)], ("ieee", "tf32x3")):
            name = f"{tiles} {precision}"
            try:
                ms, codes = graph_ms(lambda: kernel(z, books, norms, tiles, precision))
            except Exception as e:
                print(f"skip {name}: {type(e).__name__}: {str(e)[:150]}", flush=True)
                continue
            differing = int((codes != ref).sum())
            results[f"{name}@{batch}"] = dict(ms=ms, differing=differing)
            print(f"B={batch:3d} {name:27} {ms * 1e3:8.1f} us per step, {differing} codes differ of "
                  f"{codes.numel()}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_s18_2_rvq.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
