"""From a Hydra config to a ready model: resolve the checkpoint (or the embedded tiny default, generated
once with seeded random weights in the official layout), load it strictly, cast each part to its
configured dtype."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from .config import ModelConfig, model_config_from_dict

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINTS = REPO / "outputs" / "checkpoints"


def model_config(cfg: DictConfig) -> ModelConfig:
    return model_config_from_dict(OmegaConf.to_container(cfg.model, resolve=True))


def embedded_checkpoint(mcfg: ModelConfig, seed: int = 0) -> Path:
    """The seeded random checkpoint of `mcfg`, written once under outputs/checkpoints/. Written into a
    temporary sibling and renamed into place (one atomic step), so processes starting together (a server
    and a client, test workers) never read a half-written one; a process that loses the race drops its copy."""
    from .checkpoint import make_random_checkpoint

    out = DEFAULT_CHECKPOINTS / f"{mcfg.name}-seed{seed}"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would stay with the checkpoint after the rename
        try:
            make_random_checkpoint(mcfg, staging, seed)
            if out.exists() and not (out / "config.json").exists():
                shutil.rmtree(out, ignore_errors=True)  # a partial one left by an older, non-atomic writer
            try:
                os.rename(staging, out)
            except OSError:  # another process renamed its copy first (same seed: the same checkpoint)
                if not (out / "config.json").exists():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out


BLAS_LIBRARIES = ("cublaslt", "cublas")


def select_blas(library: str) -> None:
    """The library torch's CUDA bf16 / fp32 GEMMs go through, for the whole process (graphs capture the
    kernels it picks, so this comes before any capture). "cublaslt" (the default, `engine.blas_library`):
    its heuristics pick faster kernels for the step's 32- and 128-row GEMMs than cuBLAS's on the H200, the
    two captured side by side in one process and timed alternately: N=32 17.77 -> 17.60 ms, N=128
    39.38 -> 38.96 ms (docs/performance.md, session 12)."""
    if library not in BLAS_LIBRARIES:
        raise ValueError(f"engine.blas_library must be one of {BLAS_LIBRARIES}, got {library!r}")
    torch.backends.cuda.preferred_blas_library(library)


def load(cfg: DictConfig, device: str | torch.device | None = None):
    """-> (model, tokenizer, rnnt_vocab, ModelConfig). `checkpoint=null` uses the embedded default of the
    selected model config (the tiny one unless told otherwise). On CUDA it also selects the GEMM library
    (`engine.blas_library`, `select_blas`)."""
    from .checkpoint import load_model

    mcfg = model_config(cfg)
    device = torch.device(device or cfg.get("device", "cpu"))
    if device.type == "cuda":
        select_blas(OmegaConf.select(cfg, "engine.blas_library", default="cublaslt"))
    if mcfg.weights == "random":
        from .checkpoint import random_model
        model, tokenizer, rnnt_vocab = random_model(mcfg, device, seed=int(cfg.get("seed", 0)))
    else:
        ckpt = Path(cfg.checkpoint) if cfg.get("checkpoint") else embedded_checkpoint(mcfg)
        model, tokenizer, rnnt_vocab, mcfg = load_model(ckpt, mcfg, device, tokenizer_path=cfg.get("tokenizer"))
    model.cast_for_inference().eval()
    return model, tokenizer, rnnt_vocab, mcfg
