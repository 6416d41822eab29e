"""Frame-step benchmark: N calls at a given call position, eager vs captured, against the memory floor.

    python scripts/bench_step.py model=nemotron_duplex model.weights=random device=cuda
    python scripts/bench_step.py ... bench.batch_sizes=[32] bench.positions=[1000] engine.graph_backend=cudagraph
    python scripts/bench_step.py -m engine.capture_buckets=[1,8,32,128],[1,2,4,8,16,32,64,128] ...

    python scripts/bench_step.py ... engine.pipeline=2      # the pipelined step, 1 or 2 deep (nemo_duplex/serving/engine.py)

Per (N, position): median GPU time per frame step (CUDA events around the served path: one input copy, the
replay, one output copy; `time_staged_steps`; the old timing of `runner(...)` stays as "call"), host time per
step (wall time to enqueue the step, before synchronising), the floor = (weight bytes read per step + per-call state bytes
read and written per step) / measured copy bandwidth, and the ratio. The weight bytes read are counted on
an eager step (nemo_duplex/serving/weight_reads.py: the tensors its ops read, and the rows it gathers from the
embedding tables), not taken from the parameter list. Also the machine's copy bandwidth
and bf16 GEMM rate. Results: a table on stdout and JSON under the run directory (or $OUT).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_duplex import runtime, settings  # noqa: E402
from nemo_duplex.serving.frame_step import special_ids  # noqa: E402
from nemo_duplex.serving.memory import kv_bytes_per_position  # noqa: E402
from nemo_duplex.serving.pages import whole_call_state  # noqa: E402
from nemo_duplex.serving.state import allocate_call_state, state_tensors  # noqa: E402
from nemo_duplex.serving.weight_reads import fixed_and_per_call  # noqa: E402

settings.register()


def copy_bandwidth(device, gib: float = 4.0) -> float:
    """Bytes read + written per second of a large device-to-device copy."""
    n = int(gib * 2**30) // 4
    a = torch.randn(n, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() * 4 / statistics.median(times)


def gemm_rate(device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * 10 / (time.perf_counter() - t0)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def state_bytes_per_call(model, st, position: int) -> dict[str, int]:
    """Bytes one call's step reads and writes in the state pools at `position` frames into the call."""
    cfg = model.cfg
    S = st.max_calls + 1
    def row(t):  # bytes of one slot row of a pooled tensor whose slot dim is `dim`
        return t.numel() * t.element_size() // S
    llm, enc = st.llm, st.encoder
    ssm = 2 * row(llm.ssm)                                    # read + write the whole SSM state
    conv = 2 * row(llm.conv)
    kv_pos, t_pos = kv_bytes_per_position(cfg)                # K and V of one position, every layer (and stream)
    llm_kv = kv_pos * (position + 1) + kv_pos                 # read K and V of every token, write one
    talker_kv = t_pos * (cfg.prompt_frames + position + 1) + t_pos
    enc_state = 2 * sum(row(t) for _, t in state_tensors(enc) if t.dim() > 1)
    return {"mamba_ssm": ssm, "mamba_conv": conv, "llm_kv": llm_kv, "talker_kv": talker_kv, "encoder": enc_state}


def bench_state(model, calls: int, frames: int, device, page_len: int | None):
    """The state pools of `calls` calls of `frames` frames (no prompt): with page_len the KV in pages as the
    engine has them, every call holding the pages of its whole length (pages.whole_call_state)."""
    if page_len:
        return whole_call_state(model, calls, frames, device, 0, page_len)
    return allocate_call_state(model, calls, frames, device, max_prompt_tokens=0)


def fill_random(st, position: int, slots: torch.Tensor, prompt_frames: int, seed: int = 0) -> None:
    """Put the slots at `position` with random (never zero) caches: timings on zeros can flatter."""
    g = torch.Generator(device=st.llm_len.device).manual_seed(seed)
    for obj in (st.llm, st.talker, st.encoder, st.codec):
        for _, t in state_tensors(obj):
            if t.dtype == torch.float8_e4m3fn:   # (no normal_ for float8) drawn in bf16 a layer at a time
                for part in t:
                    part.copy_(torch.empty(part.shape, device=part.device, dtype=torch.bfloat16).normal_(
                        0, 0.5, generator=g))
            elif t.is_floating_point():
                t.normal_(0, 0.5, generator=g)
    st.llm_len[slots] = position
    st.talker_pos[slots] = prompt_frames + position
    st.frame[slots] = position
    st.speech_frame[slots] = position
    st.prev_codes[slots] = 0
    if hasattr(st.encoder, "frames"):
        st.encoder.frames[slots] = position


def time_steps(fn, iters: int, warmup: int, device):
    for _ in range(warmup):
        fn()
    if device.type != "cuda":  # CPU smoke runs: wall time is both numbers
        t = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        return statistics.median(t), statistics.median(t)
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        e.record()
        torch.cuda.synchronize()
        gpu.append(s.elapsed_time(e) / 1e3)
    return statistics.median(gpu), statistics.median(host)


def time_staged_steps(runner, slots, audio, forced, sampling: bool, iters: int, warmup: int):
    """The serving engine's step (graphs/capture.py step_to_host: numpy in, one input copy, the replay, one
    output copy, numpy out), timed on the device from just before its input copy to just after its output
    copy, and on the host from the call to the last launch. Why beside `time_steps`: that one times
    `runner(...)`, whose inputs are padded and copied by some ten torch calls after its start event, so
    the device waits for the host there (0.16-0.62 ms a step on the H200), which no served step does."""
    args = (slots.numpy(), audio.numpy(), forced.numpy())
    for _ in range(warmup):
        runner.step_to_host(*args, sampling=sampling)
    gpu, host = [], []
    for _ in range(iters):
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        t0 = time.perf_counter()
        out = runner.step_to_host(*args, sampling=sampling, events=events)
        host.append(out.launched - t0)
        torch.cuda.synchronize()
        gpu.append(events[0].elapsed_time(events[1]) / 1e3)
    return statistics.median(gpu), statistics.median(host)


@hydra.main(config_path="../conf", config_name="bench_step", version_base=None)
def main(cfg: DictConfig) -> None:
    from graphs.capture import buckets_for
    from nemo_duplex.serving.runner import build_runner, engine_compile_cache

    b = cfg.bench
    device = torch.device(cfg.device)
    max_n = max(b.batch_sizes)
    max_pos = max(b.positions)
    frames = max_pos + 4 * (b.iters + b.warmup) + 8
    t0 = time.perf_counter()
    with runtime.refusals("bench_step"):
        loaded = runtime.load(cfg, device, calls=(max_n, frames * 0.08))
    model, tok, _, mcfg = loaded
    print(runtime.summary(cfg, loaded, "bench_step"), flush=True)
    print(f"model ready in {time.perf_counter() - t0:.0f} s; weights {weight_bytes(model) / 2**30:.1f} GiB", flush=True)
    st = bench_state(model, max_n, frames, device, cfg.engine.kv_page_len if b.paged else None)
    on_gpu = device.type == "cuda"
    if on_gpu:
        print(f"state pools for {max_n} calls: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated", flush=True)
    bw = copy_bandwidth(device) if on_gpu else float(cfg.bench.cpu_bandwidth)
    flops = gemm_rate(device) if on_gpu else float("nan")
    wbytes = weight_bytes(model)
    specials = special_ids(model, device)
    read_fixed, read_per_call, _ = fixed_and_per_call(model, st, specials, device)
    print(f"weights read per step: {read_fixed / 2**30:.2f} GiB + {read_per_call / 2**10:.0f} KiB per call "
          f"(parameters: {wbytes / 2**30:.2f} GiB)", flush=True)
    buckets = buckets_for(cfg.engine.capture_buckets, max_n)
    graphs = build_runner(model, st, specials, buckets, graphs=cfg.engine.graphs, backend=cfg.engine.graph_backend,
                        greedy_graphs=cfg.engine.greedy_graphs, side_stream=cfg.engine.side_stream,
                        pipeline=cfg.engine.pipeline, llm_sm_carveout=cfg.engine.llm_sm_carveout,
                        dynamic_batch=cfg.engine.compile_dynamic_batch,
                        compile_cache=engine_compile_cache(model, device, cfg.engine, buckets))
    # the benchmark's calls are greedy (SamplingParams' default): with engine.greedy_graphs the engine would
    # run them through the greedy-only graphs, so those are what is timed then
    sampling = not cfg.engine.greedy_graphs
    eager = build_runner(model, st, specials, buckets, graphs=False, side_stream=cfg.engine.side_stream,
                       pipeline=cfg.engine.pipeline, llm_sm_carveout=cfg.engine.llm_sm_carveout)
    t0 = time.perf_counter()
    graphs.capture()
    capture_s = time.perf_counter() - t0
    if graphs.graphs and cfg.engine.graph_backend in ("reduce-overhead", "cudagraph"):
        # where a whole-step build spent its time (Dynamo, AOT, Inductor's passes), for docs/performance.md
        print(f"capture {capture_s:.0f} s; torch.compile's phases:\n{torch._dynamo.utils.compile_times()}", flush=True)
    rows = []
    n_in = mcfg.samples_per_frame_in
    for pos in b.positions:
        for n in b.batch_sizes:
            slots = torch.arange(n, dtype=torch.int64)
            audio = torch.randn(n, n_in) * 0.1
            forced = torch.full((n,), -1, dtype=torch.int64)
            per_call = state_bytes_per_call(model, st, pos)
            floor_s = (read_fixed + n * (read_per_call + sum(per_call.values()))) / bw
            row = {"n": n, "position": pos, "floor_ms": floor_s * 1e3,
                   "state_bytes_per_call": per_call, "weight_bytes": wbytes,
                   "weight_bytes_read": read_fixed + n * read_per_call}
            for name, runner in (("graphs", graphs), ("eager", eager)):
                if name == "eager" and not b.compare_eager:
                    continue
                fill_random(st, pos, slots.to(device), mcfg.prompt_frames)
                g, h = time_steps(lambda: runner(slots, audio, forced, sampling), b.iters, b.warmup, device)
                row[f"{name}_gpu_ms"], row[f"{name}_host_ms"] = g * 1e3, h * 1e3
                if name == "graphs" and runner.staged and on_gpu:   # its timing is CUDA events
                    # the served path; the figures above (runner(...) timed from the call) then stay as "call"
                    row["graphs_call_gpu_ms"], row["graphs_call_host_ms"] = g * 1e3, h * 1e3
                    fill_random(st, pos, slots.to(device), mcfg.prompt_frames)
                    g, h = time_staged_steps(runner, slots, audio, forced, sampling, b.iters, b.warmup)
                    row["graphs_gpu_ms"], row["graphs_host_ms"] = g * 1e3, h * 1e3
            row["ratio_to_floor"] = row["graphs_gpu_ms"] / row["floor_ms"]
            rows.append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                              if k not in ("state_bytes_per_call",)}), flush=True)
    result = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "torch": torch.__version__,
              "copy_bandwidth_GBps": bw / 1e9, "bf16_gemm_TFLOPs": flops / 1e12,
              "capture_s": capture_s, "backend": cfg.engine.graph_backend, "graphs": graphs.graphs,
              "pipeline": graphs.step.pipeline, "llm_sm_carveout": graphs.step.llm_sm_carveout,
              "regions": {r.name: r.failed or "compiled" for r in graphs.regions},
              "buckets": buckets, "dtype": mcfg.dtype.llm, "rows": rows,
              "config": runtime.effective_settings(cfg, loaded)}
    out_dir = Path(os.environ.get("OUT") or runtime.run_dir())
    runtime.write_settings(out_dir, cfg, loaded)
    (out_dir / f"bench_step_{int(time.time())}.json").write_text(json.dumps(result, indent=1))
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s, bf16 GEMM {flops / 1e12:.0f} TFLOP/s, capture {capture_s:.0f} s "
          f"({cfg.engine.graph_backend}, pipeline {graphs.step.pipeline}, LLM SM carveout {graphs.step.llm_sm_carveout}), "
          f"weights {wbytes / 2**30:.1f} GiB, read per step {read_fixed / 2**30:.2f} GiB "
          f"+ {read_per_call / 2**10:.0f} KiB per call")
    for r in graphs.regions:
        print(f"region {r.name}: {'compiled' if r.failed is None else 'eager after a failed compile: ' + r.failed}")
    print(f"{'N':>4} {'pos':>5} {'floor ms':>9} {'graph ms':>9} {'host ms':>8} {'ratio':>6} {'eager ms':>9} "
          f"{'eager host':>10} {'call ms':>8}")
    for r in rows:
        print(f"{r['n']:>4} {r['position']:>5} {r['floor_ms']:>9.2f} {r['graphs_gpu_ms']:>9.2f} "
              f"{r['graphs_host_ms']:>8.2f} {r['ratio_to_floor']:>6.2f} {r.get('eager_gpu_ms', float('nan')):>9.2f} "
              f"{r.get('eager_host_ms', float('nan')):>10.2f} {r.get('graphs_call_gpu_ms', float('nan')):>8.2f}")


if __name__ == "__main__":
    main()
