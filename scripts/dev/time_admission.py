"""How long a new call's admission takes on the full model (random weights): the prompt's prefill pieces
and the talker warm-up, each timed with the device synchronised, then the whole admission's host time
(until its last launch returns) and wall time (until the device is done), eager and replayed from CUDA
graphs (engine.prefill_graphs), and the ops that dominate the eager one. With --burst N: N calls with a cached
prompt admitted one by one (a wait each, as the admission thread did) against all at once (restore_admissions).

    python scripts/dev/time_admission.py [--prompt-tokens 500] [--chunk 256] [--device cuda] [--burst 64]
    python scripts/dev/time_admission.py --model nemotron_duplex_tiny --device cpu --prompt-tokens 40 --chunk 16
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_duplex import runtime, settings  # noqa: E402
from nemo_duplex.models.config import SamplingParams  # noqa: E402
from nemo_duplex.serving.admission_graphs import AdmissionGraphs  # noqa: E402
from nemo_duplex.serving.frame_step import admission, admission_key, restore_admissions  # noqa: E402
from nemo_duplex.serving.state import PrefixCache, allocate_call_state  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="nemotron_duplex", help="a preset (nemotron_duplex_tiny for a CPU check)")
    ap.add_argument("--burst", type=int, default=0, help="also time N calls admitted from the prefix cache")
    args = ap.parse_args()
    dev = torch.device(args.device)
    from hydra import compose, initialize_config_dir

    settings.register()
    with initialize_config_dir(str(Path(__file__).resolve().parents[2] / "conf"), version_base=None):
        cfg = compose("bench_step", overrides=[f"model={args.model}", "model.weights=random",
                                               f"device={args.device}", "model/dtype=bf16"])
    model = runtime.load(cfg, overrides=[]).model   # as the server loads it (bf16, cast for inference)
    st = allocate_call_state(model, max(4, args.burst), 400, dev, max_prompt_tokens=512)
    ids = torch.randint(3, model.cfg.llm.vocab_size, (args.prompt_tokens,), device=dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    graphs = None
    if dev.type == "cuda":
        graphs = AdmissionGraphs(model, st, args.chunk, graphs=True)
        t = time.perf_counter()
        graphs.capture()
        print(f"captured {len(graphs.prefills.keys)} prefill sizes and the warm-up in {time.perf_counter() - t:.1f} s")
    runs = [("eager whole", 0, None), ("eager pieces", args.chunk, None)]
    if graphs is not None:
        runs.append(("graphs", args.chunk, graphs))
    for label, chunk, g in runs:
        for trial in range(3):
            pieces, t = [], time.perf_counter()
            for _ in admission(model, st, trial % 4, ids, 0, SamplingParams(), None, None, chunk, g):
                sync()
                pieces.append(time.perf_counter() - t)
                t = time.perf_counter()
            sync()
            pieces.append(time.perf_counter() - t)
            sync()
            t = time.perf_counter()
            for _ in admission(model, st, trial % 4, ids, 0, SamplingParams(), None, None, chunk, g):
                pass
            host = time.perf_counter() - t
            sync()
            wall = time.perf_counter() - t
            print(f"{label}: trial {trial}: pieces ms {[round(1000 * p, 1) for p in pieces]}; unsynchronised: "
                  f"host {1000 * host:.1f} ms, until done {1000 * wall:.1f} ms", flush=True)
    if args.burst:
        time_burst(model, st, ids, args.burst, sync)
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in admission(model, st, 1, ids, 0, SamplingParams(), None, None, args.chunk):
            pass
        sync()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)


def time_burst(model, st, ids: torch.Tensor, n: int, sync) -> None:
    cache = PrefixCache(1 << 40)
    for _ in range(2):   # cached on its second admission
        for _ in admission(model, st, 0, ids, 0, SamplingParams(), None, cache):
            pass
    snap = cache.get(admission_key(model, ids, None))
    for trial in range(3):
        sync()
        t = time.perf_counter()
        for slot in range(n):
            for _ in admission(model, st, slot, ids, slot, SamplingParams(), None, cache):
                pass
            sync()
        alone = time.perf_counter() - t
        t = time.perf_counter()
        restore_admissions(model, st, list(range(n)), snap, list(range(n)), [SamplingParams()] * n)
        host = time.perf_counter() - t
        sync()
        together = time.perf_counter() - t
        print(f"burst of {n} cached: trial {trial}: one by one {1000 * alone:.1f} ms; together: host "
              f"{1000 * host:.1f} ms, until done {1000 * together:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
