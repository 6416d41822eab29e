"""Offline evaluation of a folder of clips: `python eval/clips.py dir=<wavs> checkpoint=<dir>`.

What it writes and measures: eval/clips/evaluate.py. The settings: conf/eval_clips.yaml (schema
eval/settings.py ClipsApp); `--help` lists them.
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

from eval.settings import register  # noqa: E402

register()


def run(cfg: DictConfig, loaded=None, show_progress: bool = True) -> Path:
    """Evaluate cfg.dir with the configured model (or `loaded` = (model, tokenizer, rnnt_vocab)).
    Returns the output directory."""
    from eval.clips.evaluate import evaluate_folder, summary_table
    from eval.gate import resolve_checkpoint_kind
    from nemo_duplex import runtime

    if not cfg.get("dir"):
        raise SystemExit("give the folder of clips: python eval/clips.py dir=<wavs> [checkpoint=<dir or repo id>]")
    if str(cfg.get("device", "cpu")) == "cpu" and cfg.eval.cpu_threads:
        import torch

        torch.set_num_threads(int(cfg.eval.cpu_threads))  # tiny ops: threads only contend
    out = Path(cfg.out) if cfg.get("out") else runtime.run_dir()
    with runtime.refusals("clips"):
        resolved = runtime.resolve_model(cfg)   # the configured checkpoint, also when the model is handed in
        if loaded is None:
            loaded = runtime.load(cfg, resolved=resolved)
            print(runtime.summary(cfg, loaded, "clips"), flush=True)
            runtime.write_settings(out, cfg, loaded)
    model, tokenizer, rnnt_vocab = tuple(loaded)[:3]
    kind = resolve_checkpoint_kind(cfg.eval.checkpoint_kind, resolved.random_weights)
    transcriber = None
    if kind == "trained":
        from eval.wer import Transcriber

        transcriber = Transcriber(cfg.eval.asr.backend, cfg.eval.asr.model_path)
    reports = evaluate_folder(model, tokenizer, rnnt_vocab, cfg.dir, out, OmegaConf.to_object(cfg.clip_eval),
                              show_progress=show_progress, mode=cfg.mode, prompt=cfg.get("prompt"),
                              seed=int(cfg.seed), sampling=OmegaConf.to_object(cfg.sampling),
                              trained=kind == "trained", transcriber=transcriber)
    print(summary_table(reports))
    print(f"wrote {out / 'summary.md'}, {out / 'summary.json'} and per-clip agent.wav, frames.tsv, timeline.png")
    return out


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval_clips")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
