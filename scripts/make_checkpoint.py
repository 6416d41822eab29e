"""Write a seeded random checkpoint in the official layout (spec 6): model.safetensors, config.json,
llm/config.json, tokenizer.json, rnnt_tokenizer/. Its text and speech are noise: for tests and speed
measurements. `--help` lists the options.

    python scripts/make_checkpoint.py model=nemotron_duplex_tiny out=outputs/ckpt/tiny seed=0
    python scripts/make_checkpoint.py model=nemotron_duplex out=/data/ckpt/full seed=0   # ~44 GB on disk

The weights are written in place (the parameters are views into the memory-mapped output file), so the
full-size checkpoint needs its 44 GB of disk but not 44 GB of RAM.
"""
from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_duplex import runtime, settings  # noqa: E402
from nemo_duplex.checkpoint.random_weights import make_random_checkpoint_in_place  # noqa: E402
from nemo_duplex.models.config import DtypeConfig  # noqa: E402
from nemo_duplex.serving.memory import GiB, weight_bytes  # noqa: E402

settings.register()


@hydra.main(config_path="../conf", config_name="make_checkpoint", version_base=None)
def main(cfg: DictConfig) -> None:
    mcfg = OmegaConf.to_object(cfg.model)
    out = Path(cfg.out) if cfg.get("out") else Path("outputs") / "checkpoints" / f"{mcfg.name}-seed{cfg.seed}"
    out = out if out.is_absolute() else Path(hydra.utils.get_original_cwd()) / out
    # the weights are stored in fp32 whatever model.dtype says (spec 6.3): that is what the disk must hold
    need = weight_bytes(dataclasses.replace(mcfg, dtype=DtypeConfig()), device="cpu")
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if need > free:
        raise SystemExit(f"make_checkpoint: refusing to run: {mcfg.name} needs {need / GiB:.2f} GiB of disk at "
                         f"{out.parent}, which has {free / GiB:.2f} GiB free")
    runtime.write_settings(runtime.run_dir(), cfg, runtime.ResolvedModel(mcfg, None))
    start = time.time()
    make_random_checkpoint_in_place(mcfg, out, seed=int(cfg.seed))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({size / 1e9:.3f} GB, seeded random weights) in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
