"""Each Triton kernel in ops/ against its torch reference at the full model's shapes, plus the codec's
per-frame decode under each GEMM choice. Median device time from CUDA-graph replays (see `timed`), bytes
moved (the minimum a kernel must read + write), GB/s, and the max error against a float64 reference.

    python scripts/dev/bench_ops.py [--out DIR] [--quick] [--sweep]       # on a CUDA machine
    TRITON_INTERPRET=1 python scripts/dev/bench_ops.py --smoke             # CPU: tiny shapes, checks the script runs

Writes DIR/bench_ops.md (tables) and DIR/bench_ops.json. `--sweep` also tries block sizes / warps /
loop forms of the decode-attention and fp32-linear kernels (what picked their defaults) and of the weight-only
FP8 kernel (whose tiles are not swept yet).

One file past 500 lines on purpose: a developer probe with one section per kernel, each a few lines of
shapes, reference and launch; split, they would only be harder to run and compare.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ops.decode_attention import decode_attention_reference, decode_attention_triton  # noqa: E402
from ops.fp32_linear import PRESPLIT_TILES, fp32_linear_reference, fp32_linear_triton, split_tf32  # noqa: E402

ROWS: list[dict] = []
LIVE_LOG: Path | None = None


def timed(fn, smoke: bool) -> float:
    """Device ms of one fn(), as the frame step runs it: replayed from a CUDA graph (no launch gaps;
    triton.testing.do_bench_cudagraph, median of 10 replays of ~20 ms of unrolled calls; no L2 flush, so
    inputs smaller than the 60 MB L2 read partly from cache). Falls back to do_bench (L2 flushed) if fn
    cannot be captured."""
    if smoke:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
    except Exception as exc:
        print(f"  (not capturable, timing eagerly: {type(exc).__name__}: {str(exc)[:120]})")
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def record(section: str, case: str, impl: str, ms: float, nbytes: float, err: float | None, **extra) -> None:
    row = dict(section=section, case=case, impl=impl, ms=ms, bytes=nbytes, GBps=nbytes / ms / 1e6 if ms > 0 else 0.0,
               max_err=err, **extra)
    ROWS.append(row)
    if LIVE_LOG is not None:  # each row as it comes, so a run cut short still leaves its numbers
        with open(LIVE_LOG, "a") as f:
            f.write(json.dumps(row) + "\n")
    err_s = "-" if err is None else f"{err:.2e}"
    more = " ".join(f"{k}={v}" for k, v in extra.items())
    print(f"[{section}] {case:<34} {impl:<40} {ms:9.4f} ms  {row['GBps']:8.1f} GB/s  err {err_s}  {more}", flush=True)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------------------------- decode attention

def attention_fp64(q, k_cache, v_cache, slots, seq_lens, scale, window):
    """decode_attention's semantics in float64 (the accuracy yardstick)."""
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache[slots].double().repeat_interleave(group, dim=1)
    v = v_cache[slots].double().repeat_interleave(group, dim=1)
    pos = torch.arange(k_cache.shape[2], device=q.device)
    valid = pos[None, :] < seq_lens[:, None]
    if window is not None:
        valid &= pos[None, :] > (seq_lens[:, None] - 1 - window)
    scores = torch.einsum("bhd,bhld->bhl", q.double(), k) * scale
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("bhl,bhld->bhd", probs, v.masked_fill(~valid[:, None, :, None], 0.0))


def bench_decode_attention(device, smoke, quick, sweep):
    # (name, heads, kv heads, head dim, scale, rows per call) -- talker rows are 2 per call (CFG streams)
    shapes = [("talker 16x72 (MHA)", 16, 16, 72, 1.0 / 16, 2), ("llm 40/8x128 (GQA 5)", 40, 8, 128, 128 ** -0.5, 1)]
    calls = [1, 32, 128] if not quick else [128]
    position, max_len, dtype = 1037, 1101, torch.bfloat16  # ~pos 1000 + the 37 warm-up frames; pool as profiled
    if smoke:
        shapes = [("talker-like", 4, 4, 18, 0.25, 2), ("llm-like", 10, 2, 24, 0.2, 1)]
        calls, position, max_len, dtype = [2], 40, 48, torch.float32
    gen = torch.Generator().manual_seed(0)
    for name, heads, kv_heads, dim, scale, per_call in shapes:
        for n in calls:
            rows = n * per_call
            q = torch.randn(rows, heads, dim, generator=gen).to(device, dtype)
            k = torch.randn(rows + 1, kv_heads, max_len, dim, generator=gen).to(device, dtype)
            v = torch.randn(rows + 1, kv_heads, max_len, dim, generator=gen).to(device, dtype)
            slots = torch.randperm(rows + 1, generator=gen)[:rows].to(device)
            seq_lens = torch.full((rows,), position, dtype=torch.int64, device=device)
            ref64 = attention_fp64(q, k, v, slots, seq_lens, scale, None)
            nbytes = rows * position * kv_heads * dim * 2 * k.element_size() + 2 * q.numel() * q.element_size()
            case = f"{name} N={n} rows={rows} len={position}"
            out = decode_attention_reference(q, k, v, slots, seq_lens, scale)
            record("decode_attention", case, "torch reference", timed(
                lambda: decode_attention_reference(q, k, v, slots, seq_lens, scale), smoke), nbytes, max_err(out, ref64))
            out = decode_attention_triton(q, k, v, slots, seq_lens, scale)
            record("decode_attention", case, "triton (defaults)", timed(
                lambda: decode_attention_triton(q, k, v, slots, seq_lens, scale), smoke), nbytes, max_err(out, ref64))
            old = _old_decode_attention()
            if old is not None:
                out = old(q, k, v, slots, seq_lens, scale)
                record("decode_attention", case, "triton before (tl.dot, padded)", timed(
                    lambda: old(q, k, v, slots, seq_lens, scale), smoke), nbytes, max_err(out, ref64))
            if not sweep:
                continue
            configs = []
            if n == max(calls):  # tile shapes, loop forms and splits at the big batch
                if kv_heads == heads:
                    configs += [dict(block_n=bn, num_warps=w) for bn, w in ((32, 1), (16, 2), (64, 4), (8, 1))]
                    configs += [dict(num_stages=st) for st in (1, 2, 4, 5)]
                    configs += [dict(block_n=32, num_warps=1, num_stages=st) for st in (2, 4)]
                    configs += [dict(num_splits=splits) for splits in (2, 4)]
                else:
                    configs += [dict(block_n=bn, num_warps=w, pipelined=p) for bn, w, p in
                                ((32, 4, True), (64, 4, False), (64, 8, True), (128, 8, True))]
            if n == min(calls):  # split counts where the batch alone cannot fill the GPU
                configs += [dict(num_splits=splits) for splits in (1, 4, 16, 32)]
            if kv_heads == heads and n not in (min(calls), max(calls)):
                configs += [dict(num_splits=splits) for splits in (1, 2, 4)]
            if kv_heads == heads and n > 1:  # smaller key blocks (more programs resident) by split count
                configs += [dict(block_n=bn, num_splits=splits) for bn in (4, 8) for splits in (1, 2, 3, 4)]
            for kw in configs:
                try:
                    out = decode_attention_triton(q, k, v, slots, seq_lens, scale, **kw)
                    ms = timed(lambda: decode_attention_triton(q, k, v, slots, seq_lens, scale, **kw), smoke)
                    label = " ".join(f"{key}={value}" for key, value in kw.items())
                    record("decode_attention sweep", case, label, ms, nbytes, max_err(out, ref64))
                except Exception as exc:  # a config that does not compile is a data point too
                    print(f"  sweep {kw} failed: {type(exc).__name__}: {str(exc)[:300]}")
            del q, k, v


def _old_decode_attention():
    """The kernel before this change, if scripts/_old_decode_attention.py is present (one-off baseline)."""
    path = Path(__file__).resolve().parent / "_old_decode_attention.py"
    if not path.exists():
        return None
    import importlib.util
    spec = importlib.util.spec_from_file_location("_old_decode_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.decode_attention_triton


# ---------------------------------------------------------------------------------------- fp32 linear

def bench_fp32_linear(device, smoke, quick, sweep):
    from nemo_duplex.models.codec import codec_gemm, exact_fp32
    # The codec decoder's GEMMs for N = 128 calls (one code frame each): (rows, in, out) per stage
    shapes = [("stage1 pwconv1 N=32", 32 * 9, 1536, 6144), ("stage1 pwconv2 N=32", 32 * 9, 6144, 1536),
              ("stage2 pwconv2 N=32", 32 * 63, 3072, 768), ("stage3 pwconv2 N=32", 32 * 441, 1536, 384),
              ("stage1 pwconv1", 128 * 9, 1536, 6144), ("stage1 pwconv2", 128 * 9, 6144, 1536),
              ("stage2 pwconv1", 128 * 63, 768, 3072), ("stage2 pwconv2", 128 * 63, 3072, 768),
              ("stage3 pwconv1", 128 * 441, 384, 1536), ("stage3 pwconv2", 128 * 441, 1536, 384),
              ("stage3 upsample", 128 * 63, 768, 384 * 7)]
    if quick:
        shapes = shapes[8:10]
    if smoke:
        shapes = [("tiny", 96, 32, 48)]
    gen = torch.Generator().manual_seed(1)
    for name, m, k, n in shapes:
        x = torch.randn(m, k, generator=gen).to(device)
        w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(device)
        b = (torch.randn(n, generator=gen) * 0.1).to(device)
        ref64 = F.linear(x.double(), w.double(), b.double())
        scale = ref64.abs().max().item()
        nbytes = (m * k + n * k + m * n) * 4
        flops = 2 * m * n * k
        case = f"{name} {m}x{k}->{n}"
        bf16x3 = codec_gemm("bf16x3", x.device)
        with exact_fp32(x.device):
            for impl, fn in (("torch F.linear fp32 (SGEMM)", lambda: fp32_linear_reference(x, w, b)),
                             ("triton tf32x3", lambda: fp32_linear_triton(x, w, b)),
                             ("triton tf32x3w (weight split first, included)",
                              lambda: fp32_linear_triton(x, w, b, precision="tf32x3w")),
                             ("torch bf16x3 (1 cuBLAS bf16 GEMM)", lambda: bf16x3(x, w, b))):
                out = fn()
                ms = timed(fn, smoke)
                record("fp32_linear", case, impl, ms, nbytes, max_err(out, ref64) / scale,
                       TFLOPs=round(flops / ms / 1e9, 1))
            variants = []  # (section, label, fp32_linear_triton keywords), the weight split beforehand (untimed)
            if sweep or "N=32" in name:  # split-K counts
                variants += [("fp32_linear split-K", f"tf32x3w presplit split_k={splits}", dict(split_k=splits))
                             for splits in (1, 2, 3, 4, 6, 8) if k % (splits * PRESPLIT_TILES[2]) == 0]
            if sweep and "N=32" not in name:
                # A sweep of (128|64, 64|128, 32|16|64, 4|8, 2-4) and (256, 64, 32, 8, 3) picked (128, 128, 32, 8, 3);
                # beside it, the larger tiles that fit in shared memory with fewer stages.
                variants += [("fp32_linear sweep", f"tf32x3w presplit tiles {tiles}", dict(tiles=tiles))
                             for tiles in ((128, 128, 32, 8, 3), (128, 256, 32, 8, 2), (256, 128, 32, 8, 2),
                                           (128, 128, 32, 8, 4), (256, 128, 32, 8, 3), (128, 256, 16, 8, 3))]
            w_hi, w_lo = split_tf32(w) if variants else (w, w)
            for section, label, kw in variants:
                try:
                    def run():
                        return fp32_linear_triton(x, w_hi, b, precision="tf32x3w", weight_lo=w_lo, **kw)
                    out = run()
                    ms = timed(run, smoke)
                    record(section, case, label, ms, nbytes, max_err(out, ref64) / scale,
                           TFLOPs=round(flops / ms / 1e9, 1))
                except Exception as exc:  # a tile that does not fit is a data point too
                    print(f"  {label} failed: {type(exc).__name__}: {str(exc)[:200]}")
        del x


# ---------------------------------------------------------------------------------------- codec decode_step

def bench_codec(device, smoke, quick, sweep):
    from nemo_duplex.models import codec as codec_module
    from nemo_duplex.models.codec_model import RVQCodec, istft
    from nemo_duplex.models.config import CodecConfig, tiny_config
    from ops import fp32_linear as fp32_linear_module

    cfg = tiny_config().codec if smoke else CodecConfig()
    codec = RVQCodec(cfg).to(device)
    codec.init_weights(torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(2)
    book = cfg.codebook_size

    # accuracy: 4 calls x 3 frames streamed, against the float64 one-shot decode (delayed by 6 samples)
    frames_n, calls = 3, 4
    codes = torch.randint(0, book, (calls, frames_n, cfg.num_quantizers), generator=gen).to(device)
    reference = copy.deepcopy(codec).double()
    with torch.no_grad():
        ref64 = istft(reference.decoder(reference.dequantize(codes).transpose(1, 2)), cfg.n_fft, cfg.hop_length)
    del reference

    def stream() -> torch.Tensor:
        state = codec.allocate_stream_state(calls + 1, device)
        slots = torch.arange(calls, device=device)
        parts = [codec.decode_step(codes[:, t], state, slots) for t in range(frames_n)]
        parts.append(codec.flush_step(state, slots))
        return torch.cat(parts, dim=1)[:, codec.stream_delay:]

    batches = [1, 8, 32, 64, 128] if not (quick or smoke) else ([128] if quick else [2])
    # (label, gemm, SPLIT_GEMM_MIN_ROWS): below that many rows a split GEMM falls back to the IEEE SGEMM;
    # the "min_rows" variants measure where the fallback should start (stage 1 has 9 rows per call)
    # ("no split-K": ops/fp32_linear.py's SPLIT_K_MAX = 1, every GEMM in one pass over K). The tf32x3w
    # variants split the weights on every step, except "split once", last (the codec then keeps them; fp16x3w
    # only that way, its per-step weight split being torch code):
    # RVQCodec.presplit_weights, what serving does (VoiceChat.cast_for_inference).
    default_min_rows, default_split = codec_module.SPLIT_GEMM_MIN_ROWS, fp32_linear_module.SPLIT_K_MAX
    default_fp16_rows = codec_module.FP16X3_MIN_ROWS
    variants = [("ieee", "ieee", default_min_rows, default_split),
                ("tf32x3", "tf32x3", default_min_rows, default_split),
                ("tf32x3w", "tf32x3w", default_min_rows, default_split),
                ("tf32x3w no split-K", "tf32x3w", default_min_rows, 1),
                ("bf16x3", "bf16x3", default_min_rows, default_split)]
    if not smoke:
        variants += [(f"tf32x3w min_rows={r}", "tf32x3w", r, default_split)
                     for r in (0, 64, 256, 512) if r != default_min_rows]
    variants.append(("tf32x3w split once", "tf32x3w", default_min_rows, default_split))
    variants.append(("fp16x3w split once", "fp16x3w", default_fp16_rows, default_split))  # the CUDA default
    if not smoke:
        variants += [(f"fp16x3w min_rows={r} split once", "fp16x3w", r, default_split)
                     for r in (0, 64, 256) if r != default_fp16_rows]
    for label, gemm, min_rows, split_max in variants:
        codec_module.SPLIT_GEMM_MIN_ROWS = codec_module.FP16X3_MIN_ROWS = min_rows
        fp32_linear_module.SPLIT_K_MAX = split_max
        codec.gemm = gemm   # after the row line: the kind reads it when it is made
        if label.endswith("split once"):
            codec.presplit_weights()
        try:
            error = max_err(stream(), ref64)
            for n in batches:
                state = codec.allocate_stream_state(n + 1, device)
                slots = torch.arange(n, device=device)
                step_codes = torch.randint(0, book, (n, cfg.num_quantizers), generator=gen).to(device)
                fn = lambda: codec.decode_step(step_codes, state, slots)  # noqa: E731
                fn()
                record("codec decode_step", f"N={n}", label, timed(fn, smoke), 0.0, error)
        finally:
            codec_module.SPLIT_GEMM_MIN_ROWS, codec_module.FP16X3_MIN_ROWS = default_min_rows, default_fp16_rows
            fp32_linear_module.SPLIT_K_MAX = default_split
    codec.gemm = "ieee"


# ---------------------------------------------------------------------------------------- other kernels

def bench_other_ops(device, smoke, quick, sweep):
    from ops.bounded_attention import bounded_attention_reference, bounded_attention_triton
    from ops.dft import basis_matmul_reference, basis_matmul_triton, irdft_basis, rdft_basis
    from ops.mamba_step import mamba_step_reference, mamba_step_triton

    gen = torch.Generator().manual_seed(3)
    n = 2 if smoke else 128
    dtype = torch.float32 if smoke else torch.bfloat16

    # encoder: 8 heads x 128, window 70 (spec 2.6), bf16
    heads, dim, window = (2, 16, 6) if smoke else (8, 128, 70)
    r = lambda *s: torch.randn(*s, generator=gen).to(device, dtype)  # noqa: E731
    q, kn, vn = r(n, heads, dim), r(n, heads, dim), r(n, heads, dim)
    keys, values, pos = r(n + 1, window, heads, dim), r(n + 1, window, heads, dim), r(window + 1, heads, dim)
    u, vb = r(heads, dim), r(heads, dim)
    slots = torch.arange(n, device=device)
    t = torch.full((n,), 500, dtype=torch.int64, device=device)
    args = (q, kn, vn, keys, values, pos, u, vb, slots, t)
    ref = bounded_attention_reference(*args)
    out = bounded_attention_triton(*args)
    nbytes = n * (window + 1) * heads * dim * 2 * q.element_size() + pos.numel() * pos.element_size()
    case = f"encoder {heads}x{dim} W={window} N={n}"
    record("bounded_attention", case, "torch reference", timed(lambda: bounded_attention_reference(*args), smoke),
           nbytes, 0.0)
    record("bounded_attention", case, "triton", timed(lambda: bounded_attention_triton(*args), smoke), nbytes,
           max_err(out, ref))

    # LLM Mamba-2: 128 heads x 80, d_state 128, 8 groups, conv kernel 4 (spec 3.1); fp32 state
    mh, mhd, ds, groups, kernel = (4, 8, 16, 2, 4) if smoke else (128, 80, 128, 8, 4)
    conv_dim = mh * mhd + 2 * groups * ds
    xbc = r(n, conv_dim)
    dt_raw = r(n, mh)
    conv_state = torch.randn(n + 1, conv_dim, kernel - 1, generator=gen).to(device, dtype)
    ssm_state = (torch.randn(n + 1, mh, mhd, ds, generator=gen) * 0.1).to(device)
    weight = (torch.randn(conv_dim, 1, kernel, generator=gen) * 0.5).to(device, dtype)
    bias = (torch.randn(conv_dim, generator=gen) * 0.1).to(device, dtype)
    a_log = torch.randn(mh, generator=gen).to(device)
    d_skip, dt_bias = torch.randn(mh, generator=gen).to(device), torch.randn(mh, generator=gen).to(device)
    margs = (weight, bias, a_log, d_skip, dt_bias, groups)
    cs, ss = conv_state.clone(), ssm_state.clone()
    ref = mamba_step_reference(xbc, dt_raw, cs, ss, slots, *margs)
    ss_ref = ss.clone()  # the state after one step (the timed loops below keep stepping cs / ss)
    cs2, ss2 = conv_state.clone(), ssm_state.clone()
    out = mamba_step_triton(xbc, dt_raw, cs2, ss2, slots, *margs)
    err = max(max_err(out, ref), max_err(ss2, ss))
    nbytes = n * (mh * mhd * ds * 4 * 2 + conv_dim * (kernel - 1) * 2 * conv_state.element_size())
    case = f"llm mamba {mh}x{mhd} N={ds} N={n}"
    record("mamba_step", case, "torch reference", timed(
        lambda: mamba_step_reference(xbc, dt_raw, cs, ss, slots, *margs), smoke), nbytes, 0.0)
    record("mamba_step", case, "triton", timed(
        lambda: mamba_step_triton(xbc, dt_raw, cs2, ss2, slots, *margs), smoke), nbytes, err)
    if sweep:  # the SSM kernel's rows per program and warps (the state is the traffic)
        for block_r, warps in ((8, 2), (16, 2), (16, 8), (32, 4), (32, 8), (64, 8)):
            cs3, ss3 = conv_state.clone(), ssm_state.clone()
            out = mamba_step_triton(xbc, dt_raw, cs3, ss3, slots, *margs, block_r=block_r, num_warps=warps)
            err3 = max(max_err(out, ref), max_err(ss3, ss_ref))
            record("mamba_step sweep", case, f"block_r={block_r} num_warps={warps}", timed(
                lambda br=block_r, w=warps: mamba_step_triton(xbc, dt_raw, cs3, ss3, slots, *margs, block_r=br,
                                                              num_warps=w), smoke), nbytes, err3)

    # DFT by matmul: the codec's per-frame inverse DFT (n 16) and the mel front end's forward (n 512), fp32
    for name, rows, basis in (("codec irdft n=16", n * 441, irdft_basis(16, device)),
                              ("mel rdft n=512", n * 17, rdft_basis(512, device))):
        x = torch.randn(rows, basis.shape[0], generator=gen).to(device)
        ref64 = basis_matmul_reference(x.double(), basis.double())
        nbytes = (x.numel() + rows * basis.shape[1] + basis.numel()) * 4
        from nemo_duplex.models.codec import exact_fp32
        with exact_fp32(x.device):
            out = basis_matmul_reference(x, basis)
            record("dft", f"{name} rows={rows}", "torch matmul fp32", timed(
                lambda: basis_matmul_reference(x, basis), smoke), nbytes, max_err(out, ref64))
        out = basis_matmul_triton(x, basis)
        record("dft", f"{name} rows={rows}", "triton", timed(lambda: basis_matmul_triton(x, basis), smoke), nbytes,
               max_err(out, ref64))

    # codec decoder: causal depthwise conv (k 7) + LayerNorm per ConvNeXt stage, fp32, one code frame per call
    from ops.dwconv_layernorm import dwconv_layer_norm_reference, dwconv_layer_norm_triton
    for channels, length in ((48, 9), (24, 63)) if smoke else ((1536, 9), (768, 63), (384, 441)):
        x = torch.randn(n, length, channels, generator=gen).to(device)
        hist = torch.randn(n + 1, 6, channels, generator=gen).to(device)
        cw = (torch.randn(channels, 1, 7, generator=gen) / 7 ** 0.5).to(device)
        cb, nw, nb = (torch.randn(channels, generator=gen).to(device) for _ in range(3))
        dargs = (x, hist, slots, cw, cb, nw, nb, 1e-6)
        ref64 = dwconv_layer_norm_reference(*(t.double() if torch.is_tensor(t) and t.is_floating_point() else t
                                              for t in dargs))
        nbytes = (2 * x.numel() + n * 6 * channels) * 4
        case = f"codec C={channels} L={length} N={n}"
        record("dwconv_layer_norm", case, "torch reference", timed(lambda: dwconv_layer_norm_reference(*dargs), smoke),
               nbytes, max_err(dwconv_layer_norm_reference(*dargs), ref64))
        record("dwconv_layer_norm", case, "triton", timed(lambda: dwconv_layer_norm_triton(*dargs), smoke), nbytes,
               max_err(dwconv_layer_norm_triton(*dargs), ref64))

    # talker: the MoG component draw (top-p 0.95 + Gumbel-max) over 1024 components, one of a frame's five;
    # its max_err column is the number of rows whose draw differs from the reference
    from ops.top_p_sample import gumbel, top_p_gumbel_argmax_reference, top_p_gumbel_argmax_triton
    comps = 16 if smoke else 1024
    logits = torch.randn(n, comps, generator=gen).to(device)
    noise = gumbel(torch.rand(n, comps, generator=gen)).to(device)
    ref = top_p_gumbel_argmax_reference(logits, noise, 0.95)
    differ = float((top_p_gumbel_argmax_triton(logits, noise, 0.95) != ref).sum())
    case = f"mog {comps} components N={n}"
    record("top_p_gumbel_argmax", case, "torch reference", timed(
        lambda: top_p_gumbel_argmax_reference(logits, noise, 0.95), smoke), logits.numel() * 8, 0.0)
    record("top_p_gumbel_argmax", case, "triton", timed(
        lambda: top_p_gumbel_argmax_triton(logits, noise, 0.95), smoke), logits.numel() * 8, differ)


# ---------------------------------------------------------------------------------------- bf16 GEMMs of a step

def step_gemm_shapes(cfg) -> list[tuple[str, int, int, int, int]]:
    """(part, in, out, count per step, rows per call) of the GEMMs one frame step runs through cuBLAS in the
    compute dtype (nn.Linear, and the encoder's k=1 convolutions): the encoder layers, the LLM blocks, the
    talker backbone (two rows per call: the conditional and unconditional streams) and the text head.
    Built on the meta device: nothing allocated."""
    from nemo_duplex.checkpoint.load import parameters_on_meta
    from nemo_duplex.models.model import VoiceChat

    with parameters_on_meta():
        model = VoiceChat(cfg)
    parts = (("encoder", model.perception.encoder.layers, 1), ("llm", model.llm.layers, 1),
             ("talker", model.talker.backbone.layers, 2))
    # linear_pos runs once, in prepare_stream (the position table), not per step
    once = {id(layer.self_attn.linear_pos) for layer in model.perception.encoder.layers}
    counts: dict[tuple, int] = {}
    for part, layers, rows in parts:
        for module in layers.modules():
            if isinstance(module, torch.nn.Linear) and id(module) not in once:
                key = (part, module.in_features, module.out_features, rows)
            elif isinstance(module, torch.nn.Conv1d) and module.kernel_size == (1,):  # run as F.linear
                key = (part, module.in_channels, module.out_channels, rows)
            else:
                continue
            counts[key] = counts.get(key, 0) + 1
    counts[("heads", cfg.llm.hidden_size, cfg.llm.vocab_size, 1)] = 1  # the text head
    return [(part, k, n, c, rows) for (part, k, n, rows), c in counts.items() if c > 0]


def bench_gemms(device, smoke, quick, sweep, skinny=False):
    """Each distinct bf16 GEMM of the step at N = 1, 32, 128 calls: time, weight bytes, and the share of
    copy bandwidth it reaches; the per-part sums say how far cuBLAS is from streaming the weights.
    `skinny` (--only skinny): the GEMMs with at most 64 rows (N = 1, 16, 32; the talker has two rows per
    call) through cuBLAS and ops/skinny_gemm.py, with their errors against fp32; --sweep: its tile shapes
    on the big ones."""
    from nemo_duplex.models.config import ModelConfig, tiny_config
    from ops.skinny_gemm import MAX_ROWS, skinny_gemm_triton
    cfg = tiny_config() if smoke else ModelConfig()
    dtype = torch.float32 if smoke and not skinny else torch.bfloat16
    section = "skinny" if skinny else "gemm"
    if skinny:
        sizes = (2,) if smoke else (1, 32) if quick else (1, 16, 32)
    else:
        sizes = (2,) if smoke else (128,) if quick else (1, 32, 128)
    sweep_shapes = {(4480, 22656), (10240, 4480), (4480, 15680), (15680, 4480), (1152, 4608), (1024, 4096)}
    totals: dict[tuple[str, int, str], list[float]] = {}
    for n_calls in sizes:
        for part, k, n, count, rows in step_gemm_shapes(cfg):
            m = n_calls * rows
            if skinny and m > MAX_ROWS:
                continue
            x = torch.randn(m, k, device=device, dtype=dtype)
            w = torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5
            ref = F.linear(x.float(), w.float()) if skinny else None
            nbytes = (n * k + m * k + m * n) * x.element_size()
            case = f"{part} {m}x{k}->{n} (x{count} per step)"
            impls = [("cuBLAS F.linear", lambda: F.linear(x, w))]
            if skinny:
                impls.append(("skinny (defaults)", lambda: skinny_gemm_triton(x, w)))
            for impl, fn in impls:
                err = max_err(fn(), ref) if ref is not None else None
                ms = timed(fn, smoke)
                record(section, case, impl, ms, nbytes, err, N=n_calls)
                t = totals.setdefault((part, n_calls, impl), [0.0, 0.0])
                t[0] += ms * count
                t[1] += nbytes * count
            if skinny and sweep and ((k, n) in sweep_shapes or smoke):
                for tiles in ((32, 128, 4, 4), (64, 64, 4, 6), (64, 256, 4, 3), (128, 128, 4, 4), (128, 64, 8, 4),
                              (32, 256, 4, 4), (64, 128, 4, 6)):
                    try:
                        def run():
                            return skinny_gemm_triton(x, w, tiles=tiles)
                        err = max_err(run(), ref)
                        record("skinny sweep", case, f"tiles {tiles}", timed(run, smoke), nbytes, err, N=n_calls)
                    except Exception as exc:
                        print(f"  sweep {tiles} failed: {type(exc).__name__}: {str(exc)[:200]}")
            del x, w, ref
    for (part, n_calls, impl), (ms, nbytes) in totals.items():
        record(f"{section} per step", f"{part} N={n_calls}", impl if skinny else "sum of its GEMMs", ms, nbytes, None)


def bench_fp8_weights(device, smoke, quick, sweep):
    """The projections `model.dtype.llm_weights` / `talker_weights` turn into float8 (the LLM's Mamba and MLP
    ones, the talker's stacked q/k/v, o, stacked gate/up, down) at N = 1, 32, 128 calls: bf16 cuBLAS against
    the FP8 GEMM (`fp8`: x quantised, torch._scaled_mm) and the weight-only kernel (`fp8_weight_only`), errors
    against the fp32 product of the bf16 weights, and each product's sum per step; --sweep: the weight-only
    kernel's tiles and splits on the LLM's shapes (--quick: N = 32 and 128 only)."""
    import triton

    from nemo_duplex.checkpoint.load import parameters_on_meta
    from nemo_duplex.models.config import ModelConfig, tiny_config
    from nemo_duplex.models.fp8_weights import LLM_PROJECTIONS
    from nemo_duplex.models.model import VoiceChat
    from ops.fp8_linear import fp8_linear, quantize_weight
    from ops.fp8_weight_linear import fp8_weight_linear_triton

    cfg = tiny_config() if smoke else ModelConfig()
    with parameters_on_meta():
        model = VoiceChat(cfg)
    shapes: dict[tuple[str, int, int, int], int] = {}   # (part, in, out, rows per call) -> count per step
    for name, module in model.llm.layers.named_modules():
        if name.rsplit(".", 1)[-1] in LLM_PROJECTIONS:
            key = ("llm", module.in_features, module.out_features, 1)
            shapes[key] = shapes.get(key, 0) + 1
    t = cfg.talker.backbone
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    for k, n in ((t.hidden_size, q + 2 * kv), (q, t.hidden_size), (t.hidden_size, 2 * t.intermediate_size),
                 (t.intermediate_size, t.hidden_size)):
        shapes[("talker", k, n, 2)] = shapes.get(("talker", k, n, 2), 0) + t.num_hidden_layers
    totals: dict[tuple[str, int, str], list[float]] = {}
    gen = torch.Generator().manual_seed(4)
    for n_calls in (2,) if smoke else (32, 128) if quick else (1, 32, 128):
        for (part, k, n, rows), count in shapes.items():
            m = n_calls * rows
            x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
            w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(device, torch.bfloat16)
            w8, scale = quantize_weight(w)
            ref = F.linear(x.float(), w.float())
            case = f"{part} {m}x{k}->{n} (x{count} per step)"
            impls = (("bf16 cuBLAS", lambda: F.linear(x, w), 2),
                     ("fp8 (x quantised, _scaled_mm)", lambda: fp8_linear(x, w8, scale), 1),
                     ("fp8_weight_only", lambda: fp8_weight_linear_triton(x, w8, scale), 1))
            for impl, fn, weight_size in impls:
                nbytes = n * k * weight_size + (m * k + m * n) * 2
                ms = timed(fn, smoke)
                record("fp8 weights", case, impl, ms, nbytes, max_err(fn(), ref), N=n_calls)
                total = totals.setdefault((part, n_calls, impl), [0.0, 0.0])
                total[0] += ms * count
                total[1] += nbytes * count
            if sweep and (part == "llm" or smoke):
                rows_tile = max(16, min(64, triton.next_power_of_2(m)))
                skinny = ((rows_tile, 64, 128, 4, 4), (rows_tile, 128, 128, 4, 4), (rows_tile, 64, 256, 4, 3),
                          (rows_tile, 32, 128, 4, 4), (rows_tile, 64, 128, 4, 6))
                wide = ((128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3),
                        (64, 64, 128, 4, 4))
                for tiles in skinny if m <= 64 else wide:
                    for split_k in (None, 1, 2, 4):
                        try:
                            def run():
                                return fp8_weight_linear_triton(x, w8, scale, tiles=tiles, split_k=split_k)
                            record("fp8 weights sweep", case, f"tiles {tiles} split {split_k}", timed(run, smoke),
                                   n * k + (m * k + m * n) * 2, max_err(run(), ref), N=n_calls)
                        except Exception as exc:
                            print(f"  sweep {tiles} {split_k} failed: {type(exc).__name__}: {str(exc)[:200]}")
            del x, w, w8, ref
    for (part, n_calls, impl), (ms, nbytes) in totals.items():
        record("fp8 weights per step", f"{part} N={n_calls}", impl, ms, nbytes, None)


# ---------------------------------------------------------------------------------------- main

def write_table(out_dir: Path, meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_ops.json").write_text(json.dumps(dict(meta, rows=ROWS), indent=1))
    lines = [f"device: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}", "",
             "| section | case | implementation | median ms | bytes (MB) | GB/s | max error | extra |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for row in ROWS:
        extra = {k: v for k, v in row.items() if k not in ("section", "case", "impl", "ms", "bytes", "GBps", "max_err")}
        err = "-" if row["max_err"] is None else f"{row['max_err']:.1e}"
        lines.append(f"| {row['section']} | {row['case']} | {row['impl']} | {row['ms']:.4f} | {row['bytes'] / 1e6:.1f} "
                     f"| {row['GBps']:.0f} | {err} | {' '.join(f'{k}={v}' for k, v in extra.items())} |")
    (out_dir / "bench_ops.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs/bench_ops"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--quick", action="store_true", help="N=128 only")
    parser.add_argument("--sweep", action="store_true", help="also sweep kernel parameters")
    parser.add_argument("--only", default="attention,linear,codec,other,gemm,skinny,fp8_weights")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    global LIVE_LOG
    Path(args.out).mkdir(parents=True, exist_ok=True)
    LIVE_LOG = Path(args.out) / "bench_ops_rows.jsonl"
    import triton
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
                torch=torch.__version__, triton=triton.__version__, command=" ".join(sys.argv))
    sections = {"attention": bench_decode_attention, "linear": bench_fp32_linear, "codec": bench_codec,
                "other": bench_other_ops, "gemm": bench_gemms,
                "skinny": functools.partial(bench_gemms, skinny=True), "fp8_weights": bench_fp8_weights}
    for name in args.only.split(","):
        try:
            sections[name](device, args.smoke, args.quick, args.sweep)
        except Exception:  # keep the other sections' numbers
            traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_table(Path(args.out), meta)
    print(f"wrote {args.out}/bench_ops.md")


if __name__ == "__main__":
    main()
