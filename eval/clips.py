"""Offline evaluation of a folder of clips: `python eval/clips.py dir=<wavs> checkpoint=<dir>`.

What it writes and measures: eval/clips/evaluate.py. The configuration: conf/eval/app/clips.yaml
(on top of conf/config.yaml).
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # run as a script: the repository root, not eval/, is what imports see
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "eval"]
    sys.path.insert(0, str(REPO))

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402


def run(cfg: DictConfig, loaded=None, show_progress: bool = True) -> Path:
    """Evaluate cfg.dir with the configured model (or `loaded` = (model, tokenizer, rnnt_vocab)).
    Returns the output directory."""
    from eval.clips.evaluate import EvalSettings, evaluate_folder, summary_table
    from eval.gate import resolve_checkpoint_kind
    from nemo_duplex import runtime
    from nemo_duplex.sampling import SamplingParams

    if not cfg.get("dir"):
        raise SystemExit("give the folder of clips: python eval/clips.py dir=<wavs> [checkpoint=<dir>]")
    if str(cfg.get("device", "cpu")) == "cpu" and cfg.eval.models.get("cpu_threads"):
        import torch

        torch.set_num_threads(int(cfg.eval.models.cpu_threads))  # tiny ops: threads only contend (gate.yaml)
    model, tokenizer, rnnt_vocab = loaded if loaded is not None else runtime.load(cfg)[:3]
    kind = resolve_checkpoint_kind(cfg.eval.checkpoint_kind, OmegaConf.select(cfg, "model.weights"),
                                   OmegaConf.select(cfg, "checkpoint"))
    transcriber = None
    if kind == "trained":
        from eval.wer import Transcriber

        transcriber = Transcriber(cfg.eval.asr.backend, cfg.eval.asr.model_path)
    out = Path(cfg.out) if cfg.get("out") else Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    settings = EvalSettings(**OmegaConf.to_container(cfg.clip_eval, resolve=True))
    reports = evaluate_folder(model, tokenizer, rnnt_vocab, cfg.dir, out, settings, show_progress=show_progress,
                              mode=cfg.mode, prompt=cfg.get("prompt"), seed=int(cfg.seed),
                              sampling=SamplingParams(**cfg.sampling), trained=kind == "trained",
                              transcriber=transcriber)
    print(summary_table(reports))
    print(f"wrote {out / 'summary.md'}, {out / 'summary.json'} and per-clip agent.wav, frames.tsv, timeline.png")
    return out


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval/app/clips")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
