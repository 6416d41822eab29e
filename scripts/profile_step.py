"""Where a frame step's GPU time goes: each stage of frame_step timed with CUDA events, N calls at a
call position (full-size model, random weights). A diagnosis tool beside bench_step.py.

    python scripts/profile_step.py model=nemotron_duplex model.weights=random device=cuda bench.batch_sizes=[32]
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_step import fill_random  # noqa: E402
from nemo_duplex import runtime  # noqa: E402
from nemo_duplex.frame_step import frame_step, special_ids  # noqa: E402
from nemo_duplex.state import allocate_call_state  # noqa: E402


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from torch.profiler import ProfilerActivity, profile

    for part in ("encoder", "llm", "talker"):
        cfg.model.dtype[part] = cfg.bench.dtype
    device = torch.device(cfg.device)
    model, _, _, mcfg = runtime.load(cfg, device)
    n_max, pos = max(cfg.bench.batch_sizes), max(cfg.bench.positions)
    st = allocate_call_state(model, n_max, pos + 64, device, max_prompt_tokens=0)
    specials = special_ids(model, device)
    for n in cfg.bench.batch_sizes:
        slots = torch.arange(n, device=device)
        fill_random(st, pos, slots, mcfg.prompt_frames)
        audio = torch.randn(n, mcfg.samples_per_frame_in, device=device) * 0.1
        forced = torch.full((n,), -1, dtype=torch.int64, device=device)
        with torch.no_grad():
            for _ in range(2):
                frame_step(model, st, slots, audio, forced, specials)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    frame_step(model, st, slots, audio, forced, specials)
                torch.cuda.synchronize()
        print(f"\n==== N={n} position={pos}: stages (device time per step) ====")
        ka = prof.key_averages()
        for stage in ("encoder", "llm", "heads", "talker", "codec", "rnnt"):
            e = [k for k in ka if k.key == stage]
            if e:
                print(f"{stage:>8}: {e[0].device_time_total / 3 / 1e3:8.2f} ms")
        print(ka.table(sort_by="device_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
