"""From a Hydra config to a ready model: resolve the checkpoint (or the embedded tiny default, generated
once with seeded random weights in the official layout), load it strictly, cast each part to its
configured dtype."""
from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from .config import ModelConfig, model_config_from_dict

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINTS = REPO / "outputs" / "checkpoints"


def model_config(cfg: DictConfig) -> ModelConfig:
    return model_config_from_dict(OmegaConf.to_container(cfg.model, resolve=True))


def embedded_checkpoint(mcfg: ModelConfig, seed: int = 0) -> Path:
    """The seeded random checkpoint of `mcfg`, written once under outputs/checkpoints/."""
    from .checkpoint import make_random_checkpoint

    out = DEFAULT_CHECKPOINTS / f"{mcfg.name}-seed{seed}"
    if not (out / "config.json").exists():
        make_random_checkpoint(mcfg, out, seed)
    return out


def load(cfg: DictConfig, device: str | torch.device | None = None):
    """-> (model, tokenizer, rnnt_vocab, ModelConfig). `checkpoint=null` uses the embedded default of the
    selected model config (the tiny one unless told otherwise)."""
    from .checkpoint import load_model

    mcfg = model_config(cfg)
    device = torch.device(device or cfg.get("device", "cpu"))
    if mcfg.weights == "random":
        from .checkpoint import random_model
        model, tokenizer, rnnt_vocab = random_model(mcfg, device, seed=int(cfg.get("seed", 0)))
    else:
        ckpt = Path(cfg.checkpoint) if cfg.get("checkpoint") else embedded_checkpoint(mcfg)
        model, tokenizer, rnnt_vocab, mcfg = load_model(ckpt, mcfg, device, tokenizer_path=cfg.get("tokenizer"))
    model.cast_for_inference().eval()
    return model, tokenizer, rnnt_vocab, mcfg
