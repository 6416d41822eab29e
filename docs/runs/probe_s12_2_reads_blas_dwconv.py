"""session 12 probe: (1) weight bytes read per step at full size; (2) cuBLAS vs cuBLASLt for the step,
captured side by side in one process and timed alternately; (3) the codec conv + norm with its split output
vs the plain kernel and a separate split pass.
Ran at 5313fa2 plus the first nemo_duplex/weight_reads.py (before 30cdc3a: view ops still counted as reads, and
dwconv_layer_norm still had its `split` variant, which 30cdc3a removed after this probe)."""
import statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path.cwd())); sys.path.insert(0, str(Path.cwd() / "scripts"))
from hydra import compose, initialize_config_dir
from bench_step import time_steps, fill_random, copy_bandwidth, state_bytes_per_call
from graphs.capture import StepRunner
from nemo_duplex import runtime
from nemo_duplex.frame_step import special_ids
from nemo_duplex.state import allocate_call_state
from nemo_duplex.weight_reads import fixed_and_per_call
from ops.dwconv_layernorm import dwconv_layer_norm
from ops.fp16x3_linear import split_fp16_rows

with initialize_config_dir(str(Path.cwd() / "conf"), version_base=None):
    cfg = compose("config", ["model=nemotron_duplex", "model.weights=random", "device=cuda"])
for part in ("encoder", "llm", "talker"):
    cfg.model.dtype[part] = "bf16"
dev = torch.device("cuda")
model, _, _, mcfg = runtime.load(cfg, dev)
st = allocate_call_state(model, 128, 1200, dev, max_prompt_tokens=0)
specials = special_ids(model, dev)
fixed, per_call, one = fixed_and_per_call(model, st, specials, dev)
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(f"weights read per step {fixed/1e9:.3f} GB fixed + {per_call/1e3:.1f} KB per call; parameters {params/1e9:.3f} GB", flush=True)
stor = {}
for n, t in [*model.named_parameters(), *model.named_buffers()]:
    if t.numel(): stor.setdefault(t.untyped_storage().data_ptr(), (n, t.untyped_storage().nbytes()))
bt = one.by_tensor()
import collections
agg = collections.Counter(); aggr = collections.Counter()
for n, b in stor.values():
    key = ".".join(n.split(".")[:3]); agg[key] += b - min(b, bt.get(n, 0)); aggr[key] += bt.get(n, 0)
for k, v in agg.most_common(12): print(f"  unread {v/1e6:9.1f} MB  {k}  (read {aggr[k]/1e6:.1f} MB)")
for k, v in aggr.most_common(14): print(f"  read {v/1e6:9.1f} MB  {k}")
bw = copy_bandwidth(dev)
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
for n in (1, 32, 128):
    s = sum(state_bytes_per_call(model, st, 1000).values())
    print(f"floor N={n} pos 1000: params {(params + n*s)/bw*1e3:.2f} ms, read {(fixed + n*(per_call+s))/bw*1e3:.2f} ms")

runners = {}
for lib in ("cublas", "cublaslt"):
    torch.backends.cuda.preferred_blas_library(lib)
    r = StepRunner(model, st, specials, [32, 128], graphs=True, backend="cudagraph-eager", greedy_graphs=True, side_stream=True)
    t0 = time.perf_counter(); r.capture(); print(f"{lib}: captured in {time.perf_counter()-t0:.0f} s", flush=True)
    runners[lib] = r
res = collections.defaultdict(list)
for rnd in range(4):
    for lib in ("cublas", "cublaslt") if rnd % 2 == 0 else ("cublaslt", "cublas"):
        for n in (32, 128):
            slots = torch.arange(n, dtype=torch.int64)
            audio = torch.randn(n, mcfg.samples_per_frame_in) * 0.1
            forced = torch.full((n,), -1, dtype=torch.int64)
            fill_random(st, 1000, slots.to(dev), mcfg.prompt_frames)
            g, h = time_steps(lambda: runners[lib](slots, audio, forced, False), 10, 2, dev)
            res[(lib, n)].append(g * 1e3)
for k, v in sorted(res.items()):
    print(f"{k[0]:>9} N={k[1]:>3}: median {statistics.median(v):.2f} ms  rounds {[round(x, 2) for x in v]}")
del runners; torch.cuda.empty_cache()

print("conv + norm: split output in the kernel vs plain kernel + split pass (graphs of 20, us per call)")
def graph_time(fn, reps=20):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): fn()
    ts = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(ts)
for n in (32, 128):
    tot = collections.Counter()
    for L, C in ((9, 1536), (63, 768), (441, 384)):
        x = torch.randn(n, L, C, device=dev); hist = torch.randn(n + 1, 6, C, device=dev)
        slots = torch.arange(n, device=dev)
        w = torch.randn(C, 1, 7, device=dev); b = torch.randn(C, device=dev); nw = torch.randn(C, device=dev); nb = torch.randn(C, device=dev)
        fused = graph_time(lambda: dwconv_layer_norm(x, hist, slots, w, b, nw, nb, 1e-6, split=True))
        plain = graph_time(lambda: dwconv_layer_norm(x, hist, slots, w, b, nw, nb, 1e-6))
        y = dwconv_layer_norm(x, hist, slots, w, b, nw, nb, 1e-6)
        sp = graph_time(lambda: split_fp16_rows(y.view(-1, C)))
        print(f"  N={n} L={L} C={C}: fused {fused:.1f}  plain {plain:.1f} + split {sp:.1f} = {plain+sp:.1f}")
        tot["fused"] += 3 * fused; tot["separate"] += 3 * (plain + sp)
    print(f"  N={n}, 9 blocks: fused {tot['fused']:.0f} us, separate {tot['separate']:.0f} us")
