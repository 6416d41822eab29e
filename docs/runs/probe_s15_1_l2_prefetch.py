"""session 15 probe: do the small parts' GEMM chains get faster if the next GEMMs' weights are prefetched into L2?

At N=32 the encoder's and the talker's bf16 GEMMs read their weights at ~1.1-1.4 TB/s (session 12), against
4.2 TB/s for a copy: each GEMM is a few us of fixed latency for 2-20 MB of weights, and the chain of
dependent kernels leaves DRAM idle between them. The weights do not depend on the activations, so they can
be fetched early. Hopper's `cp.async.bulk.prefetch.L2.global [addr], size` (PTX ISA 8.0, sm_90) asks the
memory system to bring `size` bytes into L2 without using a register or shared memory, so a kernel already
in the chain (a norm or an activation between two GEMMs) can issue it for the weights of a GEMM D places
ahead at almost no cost of its own.

This times one chain per part, at the step's rows, captured in one CUDA graph and replayed:

* encoder: 24 layers x its 8 GEMMs ([32 x 1024] rows; FF1 up/down, q/k/v, out, pointwise 1/2, FF2 up/down);
* talker backbone: 28 layers x its 4 GEMMs (64 rows: two per call; qkv, o, gate/up, down);

each GEMM on its own weight (1.1-1.2 GB per chain, over 20x the L2), with a small Triton "glue" kernel
between two GEMMs (SiLU of the previous output, the next GEMM's input), as the served step has a norm or an
activation there. Ways:

* `off`: glue only (as served);
* `D=1/2/3`: the glue before GEMM j also prefetches GEMM j+D's weight into L2, split over its programs;
* `hot`: every layer uses layer 0's weights (the most L2 can give, not a real step).

Each way's final output is compared with `off` (bit for bit: a prefetch changes no value).

    python3 docs/runs/probe_s15_1_l2_prefetch.py            # on the device
    TRITON_INTERPRET=1 python docs/runs/probe_s15_1_l2_prefetch.py small   # the glue's arithmetic on a CPU
                                                                            # (no prefetch: no PTX there)
"""
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SMALL = len(sys.argv) > 1 and sys.argv[1] == "small"
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CHUNK = tl.constexpr(16384)  # bytes per prefetch instruction


@triton.jit
def _glue_kernel(x_ptr, out_ptr, n_in, n_out, w_addr, w_bytes, chunks_per_program,
                 BLOCK: tl.constexpr, CHUNKS: tl.constexpr, PREFETCH: tl.constexpr):
    """out[row, k] = silu(x[row, k % n_in]) for k < n_out; optionally prefetch a slice of a weight into L2."""
    row = tl.program_id(0)
    if PREFETCH:
        c = row * chunks_per_program + tl.arange(0, CHUNKS)
        start = tl.minimum(c.to(tl.int64) * CHUNK, w_bytes - 16)        # past the end: re-ask the last 16 B
        size = tl.maximum(tl.minimum(w_bytes - start, CHUNK), 16).to(tl.int32)
        live = c < (row + 1) * chunks_per_program
        size = tl.where(live, size, 16)
        done = tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
            [w_addr + start, size], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + c, done, mask=done != 0)   # never true: keeps the asm alive
    k = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_in + k % n_in, mask=k < n_out, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_out + k, (x * tl.sigmoid(x)).to(out_ptr.dtype.element_ty), mask=k < n_out)


def glue(x, n_out, weight=None):
    rows, n_in = x.shape
    out = torch.empty(rows, n_out, device=x.device, dtype=x.dtype)
    if weight is None:
        _glue_kernel[(rows,)](x, out, n_in, n_out, 0, 16, 1, BLOCK=triton.next_power_of_2(n_out), CHUNKS=1,
                              PREFETCH=False)
        return out
    w_bytes = weight.numel() * weight.element_size()
    per = triton.cdiv(triton.cdiv(w_bytes, CHUNK.value), rows)
    _glue_kernel[(rows,)](x, out, n_in, n_out, weight.data_ptr(), w_bytes, per,
                          BLOCK=triton.next_power_of_2(n_out), CHUNKS=triton.next_power_of_2(per), PREFETCH=True)
    return out


def chain(x, weights, distance):
    """weights: the GEMMs in order, [N, K] each; distance 0 = no prefetch."""
    for j, w in enumerate(weights):
        ahead = weights[j + distance] if distance and j + distance < len(weights) else None
        x = F.linear(glue(x, w.shape[1], ahead), w)
    return x


def graph_ms(fn, replays=20):
    if dev.type != "cuda":
        fn()
        return float("nan")
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
    return statistics.median(times), out


def main():
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    enc_layer = [(1024, 4096), (4096, 1024), (1024, 3072), (1024, 1024), (1024, 2048), (1024, 1024),
                 (1024, 4096), (4096, 1024)]
    talker_layer = [(1152, 3456), (1152, 1152), (1152, 9216), (4608, 1152)]
    parts = [("encoder", 32, 24, enc_layer), ("talker", 64, 28, talker_layer)]
    if SMALL:
        parts = [("small", 4, 2, [(64, 96), (96, 64)])]
    for name, rows, layers, layer in parts:
        weights = [torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5 for _ in range(layers) for k, n in layer]
        hot = weights[:len(layer)] * layers
        gb = sum(w.numel() * w.element_size() for w in weights) / 1e9
        x0 = torch.randn(rows, layer[0][0], device=dev, dtype=dtype)
        print(f"== {name}: {rows} rows, {layers} layers x {len(layer)} GEMMs, {gb:.3f} GB of weights", flush=True)
        if dev.type != "cuda":
            ref = x0.float()
            for w in weights:
                xin = ref[:, torch.arange(w.shape[1]) % ref.shape[1]]
                ref = F.silu(xin) @ w.float().t()
            got = chain(x0, weights, 0)
            print("  glue arithmetic: max |diff| vs torch", (got.float() - ref).abs().max().item())
            continue
        base_ms, base = graph_ms(lambda: chain(x0, weights, 0))
        print(f"  off   {base_ms * 1e3:8.1f} us   {gb / base_ms * 1e3:6.0f} GB/s of weights", flush=True)
        for d in (1, 2, 3):
            ms, out = graph_ms(lambda: chain(x0, weights, d))
            same = torch.equal(out, base)
            print(f"  D={d}   {ms * 1e3:8.1f} us   {gb / ms * 1e3:6.0f} GB/s   same bits as off: {same}", flush=True)
        ms, _ = graph_ms(lambda: chain(x0, hot, 0))
        print(f"  hot   {ms * 1e3:8.1f} us   (layer 0's weights everywhere: an L2 bound)", flush=True)
        ms, _ = graph_ms(lambda: [glue(x0, k) for _ in range(layers) for k, n in layer][-1])
        print(f"  glue kernels alone {ms * 1e3:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
