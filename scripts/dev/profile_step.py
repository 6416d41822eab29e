"""Where a frame step's GPU time goes, N calls at a call position (full-size model, random weights).
A diagnosis tool beside bench_step.py.

    python scripts/dev/profile_step.py model=nemotron_duplex model.weights=random device=cuda bench.batch_sizes=[32]
    python scripts/dev/profile_step.py ... profile.graphs=true engine.graph_backend=cudagraph-eager

Eager (default): each stage of frame_step (its record_function range) with the sum of its kernels' device
time, then the busiest ops. With `profile.graphs=true`: the step captured as the serving path captures
it (`engine.graph_backend`), and the kernels of its replays by name and by kind (GEMM, attention, Mamba,
elementwise, ...), with the kernel count per step: launch gaps are gone there, so this is where the
remaining time is. Then, per CUDA stream of the replay, how long it had a kernel running, and each stage's
span in the step (which stages ran beside which: engine.pipeline, frame_step's branches). `profile.host=N`: N
calls' host path by function (cProfile): whose is a back end's host time.
"""
from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/: bench_step

from bench_step import bench_state, fill_random  # noqa: E402

from nemo_duplex import runtime, settings  # noqa: E402
from nemo_duplex.serving.frame_step import frame_step, special_ids  # noqa: E402

STEPS = 3
settings.register()
KINDS = [  # (kind, pattern on the kernel name), first match wins
    ("decode attention", r"decode_attention|merge_splits"),
    ("mamba step", r"ssm_step|conv_step"),
    ("encoder attention", r"bounded_attention"),
    ("fp32 GEMM (Triton)", r"fp32_linear|fp16x3|basis_matmul"),  # the codec's fp32-accurate GEMMs, the DFT
    ("GEMM (cuBLAS)", r"gemm|nvjet|xmma|cutlass|sm90_|sm80_"),
    ("Inductor fused", r"^triton_"),
    ("reduction", r"reduce|softmax|norm|topk|sort|scan|argmax"),
    ("copy / index", r"copy|index|scatter|gather|cat|fill"),
    ("elementwise", r"elementwise"),
]


def kind_of(name: str) -> str:
    return next((k for k, p in KINDS if re.search(p, name, re.IGNORECASE)), "other")


def kernel_events(prof):
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (us)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def print_stream_overlap(kernels) -> None:
    """Per CUDA stream (the profiler's resource id), the time it had a kernel running, and the time the
    GPU had any kernel running, per step: with work on several streams (frame_step's branches), what ran
    beside what, and how long the GPU sat without a kernel."""
    spans = defaultdict(list)
    for e in kernels:
        spans[e.device_resource_id].append((e.time_range.start, e.time_range.end))
    every = [iv for ivs in spans.values() for iv in ivs]
    wall = (max(b for _, b in every) - min(a for a, _ in every)) / STEPS / 1e3
    print(f"streams: wall {wall:.2f} ms per step, some kernel running {busy_us(every) / STEPS / 1e3:.2f} ms")
    for sid, ivs in sorted(spans.items(), key=lambda kv: -len(kv[1])):
        print(f"  stream {sid}: {len(ivs) / STEPS:.0f} kernels, running {busy_us(ivs) / STEPS / 1e3:.2f} ms per step")


STAGE_MARKERS = [  # kernels only one stage launches: the stage's span runs from its first to its last
    ("encoder", r"_bounded_attention_kernel|_conformer_conv_kernel|_add_layer_norm_kernel"),
    ("llm", r"_ssm_step_kernel|_conv_step_kernel|_relu_square_kernel|_decode_attention_group_kernel"),
    ("heads", r"_argmax_top2_kernel"),  # (not "_top_p": that is the talker's _top_p_gumbel_argmax_kernel)
    ("talker", r"_decode_attention_vector_kernel|_rms_norm_rope_kernel|_gelu_tanh_mul_kernel|_mog_latent_kernel|"
               r"_argmin_residual_kernel"),
    ("codec", r"_fp16x3_kernel|_dwconv_layer_norm_kernel|_istft_step_kernel"),
    ("rnnt", r"lstm_cell|_rnnt_commit_kernel"),
]


def print_stage_spans(kernels, first_kernels: int = 40) -> None:
    """Each stage's span in a step (from its first marker kernel's start to its last one's end, ms after
    the step's first kernel), averaged over the profiled steps: which stages ran beside which."""
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    per = len(ordered) // STEPS
    spans = defaultdict(lambda: [0.0, 0.0])
    for k in range(STEPS):
        step = ordered[k * per: (k + 1) * per]
        t0 = step[0].time_range.start
        for stage, pattern in STAGE_MARKERS:
            hits = [e for e in step if re.search(pattern, e.name)]
            if hits:
                spans[stage][0] += (min(e.time_range.start for e in hits) - t0) / STEPS / 1e3
                spans[stage][1] += (max(e.time_range.end for e in hits) - t0) / STEPS / 1e3
        spans["step"][1] += (max(e.time_range.end for e in step) - t0) / STEPS / 1e3
    first = ordered[per: 2 * per][:first_kernels]
    t0 = first[0].time_range.start
    print("the second step's first kernels (start, length in us): " +
          "; ".join(f"{(e.time_range.start - t0):.0f} +{e.time_range.elapsed_us():.0f} {e.name[:70]}" for e in first))
    print("stage spans (ms from the step's first kernel): " +
          ", ".join(f"{name} {a:.2f}-{b:.2f}" for name, (a, b) in spans.items()))


def print_graph_profile(prof, n: int, pos: int, top: int = 45, first_kernels: int = 40) -> None:
    by_name, by_kind, count = defaultdict(float), defaultdict(float), defaultdict(int)
    kernels = kernel_events(prof)
    for e in kernels:
        t = e.time_range.elapsed_us() / STEPS / 1e3  # ms per step
        by_name[e.name] += t
        by_kind[kind_of(e.name)] += t
        count[kind_of(e.name)] += 1
    total = sum(by_kind.values())
    print(f"\n==== N={n} position={pos}: captured step, {len(kernels) / STEPS:.0f} kernels and {total:.2f} ms "
          f"of kernel time per step ====")
    for k, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"{k:>20}: {t:8.2f} ms  {count[k] / STEPS:6.0f} kernels")
    print_stream_overlap(kernels)
    print_stage_spans(kernels, first_kernels)
    print("busiest kernels (ms per step):")
    calls = defaultdict(int)
    for e in kernels:
        calls[e.name] += 1
    for name, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{t:8.3f}  {calls[name] / STEPS:5.0f}x  {name[:150]}")


def print_host_profile(step_to_host, calls: int, top: int) -> None:
    """The host side of `calls` served steps (`step_to_host`, as the engine calls it: numpy in, the launches,
    a wait, numpy out): each call's host time to its last launch (bench_step's `host ms`), then the Python
    functions the calls spend their time in under cProfile, by own time (the wait for the GPU shows as
    `synchronize`). Why: a back end's host time per step is launch work that the GPU may wait for; this says
    whose it is (the runner, Dynamo's guards, AOTAutograd's wrappers, cudagraph trees' checks, the launch)."""
    import cProfile
    import pstats
    import time

    def launch_ms() -> float:
        t0 = time.perf_counter()
        return (step_to_host().launched - t0) * 1e3

    launch = sorted(launch_ms() for _ in range(calls))
    print(f"host per step to its last launch (no profiler): median {launch[len(launch) // 2]:.3f} ms, "
          f"min {launch[0]:.3f}")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step_to_host()
    profiler.disable()
    print(f"host profile of {calls} steps (cProfile's own overhead included):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(top)


@hydra.main(config_path="../../conf", config_name="profile_step", version_base=None)
def main(cfg: DictConfig) -> None:
    from torch.profiler import ProfilerActivity, profile

    from nemo_duplex.serving.runner import build_runner, engine_compile_cache

    if cfg.profile.host < 0 or (cfg.profile.host and not cfg.profile.graphs):
        raise SystemExit(f"profile_step: profile.host={cfg.profile.host}: the number of captured steps whose host path "
                         "to profile, >= 0, and only with profile.graphs=true")
    device = torch.device(cfg.device)
    n_max, pos = max(cfg.bench.batch_sizes), max(cfg.bench.positions)
    with runtime.refusals("profile_step"):
        loaded = runtime.load(cfg, device, calls=(n_max, (pos + 64) * 0.08))
    model, _, _, mcfg = loaded
    print(runtime.summary(cfg, loaded, "profile_step"), flush=True)
    runtime.write_settings(runtime.run_dir(), cfg, loaded)
    st = bench_state(model, n_max, pos + 64, device, cfg.engine.kv_page_len if cfg.bench.paged else None)
    specials = special_ids(model, device)
    on_graphs = cfg.profile.graphs
    for n in cfg.bench.batch_sizes:
        slots = torch.arange(n, device=device)
        fill_random(st, pos, slots, mcfg.prompt_frames)
        audio = torch.randn(n, mcfg.samples_per_frame_in, device=device) * 0.1
        forced = torch.full((n,), -1, dtype=torch.int64, device=device)
        if on_graphs:
            # profile.greedy=true: the greedy-only graph (engine.greedy_graphs), what bench_step times
            greedy = cfg.profile.greedy
            runner = build_runner(model, st, specials, [n], graphs=True, backend=cfg.engine.graph_backend,
                                side_stream=cfg.engine.side_stream, greedy_graphs=greedy,
                                pipeline=cfg.engine.pipeline, llm_sm_carveout=cfg.engine.llm_sm_carveout,
                                dynamic_batch=cfg.engine.compile_dynamic_batch,
                                compile_cache=engine_compile_cache(model, device, cfg.engine, [n]))
            runner.capture()
            step = lambda: runner(slots, audio, forced, sampling=not greedy)  # noqa: E731
        else:
            step = lambda: frame_step(model, st, slots, audio, forced, specials)  # noqa: E731
        with torch.no_grad():
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(STEPS):
                    step()
                torch.cuda.synchronize()
        if on_graphs:
            # profile.top=N: more names; profile.first=N: the second step's first N kernels with their times
            print_graph_profile(prof, n, pos, cfg.profile.top, cfg.profile.first)
            if cfg.profile.host:
                host_args = (slots.cpu().numpy(), audio.cpu().numpy(), forced.cpu().numpy())
                print_host_profile(lambda: runner.step_to_host(*host_args, sampling=not greedy), cfg.profile.host,
                                   cfg.profile.top)
            del runner
            continue
        print(f"\n==== N={n} position={pos}: stages (kernel time per step, eager) ====")
        ka = prof.key_averages()
        for stage in ("encoder", "llm", "heads", "talker", "codec", "rnnt"):
            # the CPU-side range: its device time is the sum of the kernels it launched (not a span)
            e = [k for k in ka if k.key == stage and k.device_type == torch.autograd.DeviceType.CPU]
            if e:
                print(f"{stage:>8}: {e[0].device_time_total / STEPS / 1e3:8.2f} ms")
        print(ka.table(sort_by="device_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
