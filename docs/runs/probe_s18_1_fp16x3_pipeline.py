"""session 18 probe: can the codec's fp16x3 GEMM keep its tensor cores busy across its per-block sums?

Session 17 measured the served kernel (ops/fp16x3_linear.py) at 1.71 ms a step at N=32 against 1.19 ms for three
plain cuBLAS fp16 GEMMs of the same shapes, and put the ~30% on the kernel's structure: each 64-column K block's
three products are summed in a fresh accumulator, which must be waited for and scaled into the fp32 sum before the
next block's products start. The variants here keep the arithmetic's accuracy class (every product exact, tensor
core sums over at most 128 columns, the running sum in fp32 on the CUDA cores) and change only the order:

* served: the kernel as the step runs it (TILES, split-K by `pick_split_k`);
* carry: software-pipelined, block i+1's products issued before block i's sum is scaled in;
* pair: two 64-column blocks per iteration, both blocks' products, then both sums;
* flush2: x scaled per 128 columns, the three products of two 64-column loads summed in the tensor cores before
  one scale-and-add (half the waits; tensor-core sums over 128 columns instead of 64: the error is measured).

Every variant's output is compared with float64 (the error relative to each row's max |y|, the max over rows), as
session 11 measured the served kernel. Timing: a CUDA graph of 10 launches replayed, median of 5 replays, at the
codec's shapes for N = 32 and 128 calls (ConvNeXtBlock.step / Latent2Wav.step's flags).

    python3 docs/runs/probe_s18_1_fp16x3_pipeline.py      # JSON to $OUT
"""
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from ops import sm_count  # noqa: E402
from ops.fp16x3_linear import (SCALE_BLOCK, TILES, Fp16Split, _epilogue, _split_k_sum_kernel,  # noqa: E402
                               fp16x3_linear_triton, pow2_scale_reference, split_fp16_rows_triton,
                               split_fp16_weight, split_scaled_reference)
from ops.fp32_linear import grouped_tile, pick_split_k  # noqa: E402

dev = torch.device("cuda")
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


@triton.jit
def _three(xh_ptr, xl_ptr, wh_ptr, wl_ptr, rows, cols, row_mask, col_mask, block, stride_xm, stride_wn,
           K: tl.constexpr, SUB: tl.constexpr, acc):
    """acc + the three products of the SUB-column block `block` (smallest first)."""
    ks = block * SUB + tl.arange(0, SUB)
    k_mask = ks < K
    x_offsets = rows[:, None] * stride_xm + ks[None, :]
    x_mask = row_mask[:, None] & k_mask[None, :]
    w_offsets = cols[None, :] * stride_wn + ks[:, None]
    w_mask = k_mask[:, None] & col_mask[None, :]
    x_hi = tl.load(xh_ptr + x_offsets, mask=x_mask, other=0.0)
    x_lo = tl.load(xl_ptr + x_offsets, mask=x_mask, other=0.0)
    w_hi = tl.load(wh_ptr + w_offsets, mask=w_mask, other=0.0)
    w_lo = tl.load(wl_ptr + w_offsets, mask=w_mask, other=0.0)
    acc = tl.dot(x_lo, w_hi, acc)
    acc = tl.dot(x_hi, w_lo, acc)
    return tl.dot(x_hi, w_hi, acc)


@triton.jit
def _variant_kernel(
    xh_ptr, xl_ptr, xinv_ptr, wh_ptr, wl_ptr, winv_ptr, b_ptr, r_ptr, y_ptr, yh_ptr, yl_ptr, yinv_ptr, part_ptr,
    M, N, stride_xm, stride_wn, stride_rm, stride_ym,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    SPLIT_OUT: tl.constexpr, SPLIT_K: tl.constexpr, MODE: tl.constexpr, XSCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr, GROUP_M: tl.constexpr,
):
    """MODE 1 carry, 2 pair, 3 flush2 (XSCALE = 128: x's scale blocks). Loads are 64 columns (SCALE) wide."""
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    K_BLOCKS: tl.constexpr = (K + SCALE - 1) // SCALE
    X_BLOCKS: tl.constexpr = (K + XSCALE - 1) // XSCALE
    BLOCKS_PER_SPLIT: tl.constexpr = K_BLOCKS // SPLIT_K
    first = tl.program_id(1) * BLOCKS_PER_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MODE == 1:
        part = _three(xh_ptr, xl_ptr, wh_ptr, wl_ptr, rows, cols, row_mask, col_mask, first, stride_xm, stride_wn,
                      K, SCALE, zero)
        for i in range(1, BLOCKS_PER_SPLIT):
            nxt = _three(xh_ptr, xl_ptr, wh_ptr, wl_ptr, rows, cols, row_mask, col_mask, first + i, stride_xm,
                         stride_wn, K, SCALE, zero)
            inv = tl.load(xinv_ptr + rows * X_BLOCKS + first + i - 1, mask=row_mask, other=0.0)
            acc += part * inv[:, None]
            part = nxt
        inv = tl.load(xinv_ptr + rows * X_BLOCKS + first + BLOCKS_PER_SPLIT - 1, mask=row_mask, other=0.0)
        acc += part * inv[:, None]
    elif MODE == 2:
        for i in range(0, BLOCKS_PER_SPLIT // 2):
            a = _three(xh_ptr, xl_ptr, wh_ptr, wl_ptr, rows, cols, row_mask, col_mask, first + 2 * i, stride_xm,
                       stride_wn, K, SCALE, zero)
            b = _three(xh_ptr, xl_ptr, wh_ptr, wl_ptr, rows, cols, row_mask, col_mask, first + 2 * i + 1,
                       stride_xm, stride_wn, K, SCALE, zero)
            inv_a = tl.load(xinv_ptr + rows * X_BLOCKS + first + 2 * i, mask=row_mask, other=0.0)
            inv_b = tl.load(xinv_ptr + rows * X_BLOCKS + first + 2 * i + 1, mask=row_mask, other=0.0)
            acc += a * inv_a[:, None]
            acc += b * inv_b[:, None]
        if BLOCKS_PER_SPLIT % 2:
            a = _three(xh_ptr, xl_ptr, wh_ptr, wl_ptr, rows, cols, row_mask, col_mask, first + BLOCKS_PER_SPLIT - 1,
                       stride_xm, stride_wn, K, SCALE, zero)
            inv_a = tl.load(xinv_ptr + rows * X_BLOCKS + first + BLOCKS_PER_SPLIT - 1, mask=row_mask, other=0.0)
            acc += a * inv_a[:, None]
    else:  # flush2: x blocks of 128 = two 64-column loads summed in the tensor cores
        for j in range(0, BLOCKS_PER_SPLIT // 2):
            part = zero
            for h in tl.static_range(2):
                part = _three(xh_ptr, xl_ptr, wh_ptr, wl_ptr, rows, cols, row_mask, col_mask, first + 2 * j + h,
                              stride_xm, stride_wn, K, SCALE, part)
            inv = tl.load(xinv_ptr + rows * X_BLOCKS + (first + 2 * j) // 2, mask=row_mask, other=0.0)
            acc += part * inv[:, None]
    acc = acc * tl.load(winv_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if SPLIT_K > 1:
        part_out = part_ptr + tl.program_id(1).to(tl.int64) * M * N
        tl.store(part_out + rows[:, None] * N + cols[None, :], acc, mask=row_mask[:, None] & col_mask[None, :])
    else:
        _epilogue(acc, rows, cols, pid_n, row_mask, col_mask, b_ptr, r_ptr, y_ptr, yh_ptr, yl_ptr, yinv_ptr, N,
                  stride_rm, stride_ym, HAS_BIAS, GELU, HAS_RESIDUAL, SPLIT_OUT, BLOCK_M, BLOCK_N, SCALE)


def split_rows_128(x):
    """x [M, K] fp32 -> halves and per-(row, 128 columns) inverse scales."""
    m, k = x.shape
    blocks = triton.cdiv(k, 128)
    padded = torch.nn.functional.pad(x, (0, blocks * 128 - k)).view(m, blocks, 128)
    scale, inv = pow2_scale_reference(padded.abs().amax(dim=2))
    hi, lo = split_scaled_reference(padded, scale[:, :, None])
    return Fp16Split(hi.reshape(m, -1)[:, :k].contiguous(), lo.reshape(m, -1)[:, :k].contiguous(), inv)


def variant(mode, x, w, bias, gelu, residual, split_out, tiles):
    m, k = x.hi.shape
    n = w.hi.shape[0]
    block_m, block_n, num_warps, num_stages = tiles
    k_blocks = triton.cdiv(k, SCALE_BLOCK)
    output_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = pick_split_k(output_tiles, k_blocks * SCALE_BLOCK, SCALE_BLOCK, sm_count(dev))
    if mode == 3 and (k_blocks // split_k) % 2:
        split_k = 1
    if split_out:
        y = torch.empty(0, device=dev)
        out = Fp16Split(torch.empty(m, n, device=dev, dtype=torch.float16),
                        torch.empty(m, n, device=dev, dtype=torch.float16),
                        torch.empty(m, triton.cdiv(n, SCALE_BLOCK), device=dev, dtype=torch.float32))
    else:
        y = torch.empty(m, n, device=dev)
        out = Fp16Split(y, y, y)
    r = residual if residual is not None else y
    part = torch.empty(split_k, m, n, device=dev) if split_k > 1 else out.inv
    b = bias if bias is not None else out.inv
    flags = dict(HAS_BIAS=bias is not None, GELU=gelu, HAS_RESIDUAL=residual is not None, SPLIT_OUT=split_out)
    _variant_kernel[(output_tiles, split_k)](
        x.hi, x.lo, x.inv, w.hi, w.lo, w.inv, b, r, y, out.hi, out.lo, out.inv, part, m, n,
        x.hi.stride(0), w.hi.stride(0), r.stride(0), n, K=k, SPLIT_K=split_k, MODE=mode,
        XSCALE=128 if mode == 3 else SCALE_BLOCK, BLOCK_M=block_m, BLOCK_N=block_n, SCALE=SCALE_BLOCK, GROUP_M=8,
        num_warps=num_warps, num_stages=num_stages, **flags)
    if split_k > 1:
        _split_k_sum_kernel[(triton.cdiv(m, 32), triton.cdiv(n, 128))](
            part, b, r, y, out.hi, out.lo, out.inv, m, n, r.stride(0), n, SPLIT_K=split_k, BLOCK_M=32, BLOCK_N=128,
            SCALE=SCALE_BLOCK, **flags)
    return out if split_out else y


VARIANTS = {  # name: (mode, tiles)
    "served": (0, TILES),
    "carry": (1, (128, 128, 8, 3)),
    "carry s2": (1, (128, 128, 8, 2)),
    "pair 128x64": (2, (128, 64, 4, 2)),
    "pair 128x128 s1": (2, (128, 128, 8, 1)),
    "flush2": (3, (128, 128, 8, 3)),
    "flush2 128x64 s4": (3, (128, 64, 4, 4)),
}


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


def as_fp64(out):
    if isinstance(out, torch.Tensor):
        return out.double()
    inv = out.inv.repeat_interleave(SCALE_BLOCK, 1)[:, :out.hi.shape[1]]
    return (out.hi.double() + out.lo.double()) * inv.double()


def main():
    results = {}
    for (name, per_call, k, n, flags, uses) in SHAPES:
        for calls in CALLS:
            m = per_call * calls
            g = torch.Generator(device=dev).manual_seed(17 + m + k + n)
            x = torch.randn(m, k, device=dev, generator=g)
            w = torch.randn(n, k, device=dev, generator=g) * k ** -0.5
            b = torch.randn(n, device=dev, generator=g) if flags.get("bias") else None
            r = torch.randn(m, n, device=dev, generator=g) if flags.get("residual") else None
            ref = x.double() @ w.double().t()
            if b is not None:
                ref = ref + b.double()
            if flags.get("gelu"):
                ref = torch.nn.functional.gelu(ref)
            if r is not None:
                ref = ref + r.double()
            ws = split_fp16_weight(w)
            xs64, xs128 = split_fp16_rows_triton(x), split_rows_128(x)
            for vname, (mode, tiles) in VARIANTS.items():
                if flags.get("split_out") and tiles[1] % SCALE_BLOCK:
                    continue
                gelu, split_out = flags.get("gelu", False), flags.get("split_out", False)
                if mode == 0:
                    fn = lambda: fp16x3_linear_triton(xs64, ws, b, gelu=gelu, residual=r, split_out=split_out)  # noqa
                else:
                    xs = xs128 if mode == 3 else xs64
                    fn = lambda: variant(mode, xs, ws, b, gelu, r, split_out, tiles)  # noqa
                try:
                    ms, out = graph_ms(fn)
                except Exception as e:
                    print(f"skip {vname} {name}@{calls}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                y = as_fp64(out)
                err = ((y - ref).abs().amax(dim=1) / ref.abs().amax(dim=1)).max().item()
                results[f"{vname}|{name}|{calls}"] = dict(ms=ms, err=err, uses=uses)
                print(f"{vname:18} {name:7} N={calls:3d} M={m:6d} {ms * 1e3:9.1f} us  err {err:.1e}", flush=True)
    summary = {}
    for calls in CALLS:
        for vname in VARIANTS:
            rows = [(s[0], results.get(f"{vname}|{s[0]}|{calls}")) for s in SHAPES]
            total, worst = 0.0, 0.0
            for shape, rec in rows:
                if rec is None:  # a variant that cannot run a shape: count the served kernel's time
                    rec = results[f"served|{shape}|{calls}"]
                total += rec["uses"] * rec["ms"]
                worst = max(worst, rec["err"])
            summary[f"{vname}@{calls}"] = dict(ms=total, worst_err=worst)
            print(f"N={calls:3d} {vname:18} per step {total:.3f} ms  worst err {worst:.1e}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_s18_1_fp16x3_pipeline.json"), "w") as f:
        json.dump(dict(results=results, summary=summary), f, indent=1)


if __name__ == "__main__":
    main()
