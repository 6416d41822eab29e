"""Run 16 kHz mono clips through the model and write what it says.

    python scripts/run_clip.py                                  # embedded tiny model, example clip
    python scripts/run_clip.py model=nemotron_duplex checkpoint=<dir> clip=a.wav mode=streaming
    python scripts/run_clip.py mode=engine clips=[a.wav,b.wav] offsets=[0,7]
    python scripts/run_clip.py mode=engine clips=[a.wav,b.wav] engine.batch_invariant=true   # bits as if alone

mode=offline is NVIDIA's offline_inference (spec 7.1); mode=streaming the per-frame cached loop
(spec 7.2); mode=engine the batched engine, several clips at once, each with its own start frame and
seed (seed + index). Writes agent.wav (22.05 kHz), frames.tsv (per-frame text and function tokens),
agent.txt, user.txt and, with dump=<file.safetensors>, the named tensors.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_duplex import runtime  # noqa: E402
from nemo_duplex.audio import read_wav, write_wav  # noqa: E402
from nemo_duplex.sampling import SamplingParams  # noqa: E402

EXAMPLE_CLIP = runtime.REPO / "eval" / "clips" / "example.wav"


def write_outputs(out: Path, res, tokenizer, rnnt_vocab, sample_rate: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_wav(out / "agent.wav", res.wav.float().cpu().numpy(), sample_rate)
    with open(out / "frames.tsv", "w") as f:
        f.write("frame\ttext_token\tfunction_token\ttext_piece\n")
        for i, (t, fn) in enumerate(zip(res.text_tokens.tolist(), res.function_tokens.tolist())):
            f.write(f"{i}\t{t}\t{fn}\t{tokenizer.id_to_token(t)!r}\n")
    (out / "agent.txt").write_text(tokenizer.decode(res.text_tokens.tolist()) + "\n")
    user = rnnt_vocab.decode(res.user_tokens) if rnnt_vocab is not None else ""
    (out / "user.txt").write_text(user + "\n")


def engine_config(cfg, n_clips: int):
    """mode=engine's engine: a slot per clip; engine.max_call_s, engine.batch_invariant and engine.pipeline
    from the config."""
    from nemo_duplex.engine import EngineConfig

    return EngineConfig(max_calls=max(n_clips, 1), max_call_s=cfg.engine.max_call_s,
                        batch_invariant=bool(cfg.engine.get("batch_invariant", False)),
                        pipeline=int(cfg.engine.get("pipeline", 0)))


def run_engine(model, tokenizer, cfg, clips, offsets, prompt, sampling):
    from nemo_duplex.engine import Engine

    engine = Engine(model, tokenizer, engine_config(cfg, len(clips)))
    return engine.run_clips(clips, offsets=offsets, prompt=prompt, seed=int(cfg.seed), sampling=sampling)


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from nemo_duplex.model import offline_inference
    from nemo_duplex.frame_step import stream_inference

    model, tokenizer, rnnt_vocab, mcfg = runtime.load(cfg)
    sr_in, sr_out = mcfg.source_sample_rate, mcfg.target_sample_rate
    sampling = SamplingParams(**cfg.sampling)
    out = Path(cfg.out) if cfg.get("out") else Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    prompt_ids = model.prompt_ids(tokenizer, cfg.prompt)

    if cfg.mode == "engine":
        paths = list(cfg.clips) if cfg.get("clips") else [cfg.clip or EXAMPLE_CLIP]
        clips = [torch.from_numpy(read_wav(p, sr_in)) for p in paths]
        offsets = list(cfg.offsets) if cfg.get("offsets") else [0] * len(clips)
        t0 = time.perf_counter()
        results = run_engine(model, tokenizer, cfg, clips, offsets, cfg.prompt, sampling)
        for i, (p, res) in enumerate(zip(paths, results)):
            write_outputs(out / f"{i:02d}_{Path(p).stem}", res, tokenizer, rnnt_vocab, sr_out)
        print(f"engine: {len(clips)} clips in {time.perf_counter() - t0:.1f} s -> {out}")
        return

    path = cfg.clip or EXAMPLE_CLIP
    audio = torch.from_numpy(read_wav(path, sr_in))
    t0 = time.perf_counter()
    if cfg.mode == "offline":
        res = offline_inference(model, audio, prompt_ids, seed=int(cfg.seed), sampling=sampling)
    elif cfg.mode == "streaming":
        res = stream_inference(model, audio, prompt_ids, seed=int(cfg.seed), sampling=sampling)
    else:
        raise ValueError(f"mode must be offline, streaming or engine, got {cfg.mode!r}")
    write_outputs(out, res, tokenizer, rnnt_vocab, sr_out)
    if cfg.get("dump"):
        from safetensors.torch import save_file
        save_file({k: v.contiguous().cpu() for k, v in res.tensors().items()}, str(cfg.dump))
    frames = res.text_tokens.shape[0]
    print(f"{cfg.mode}: {Path(str(path)).name}: {frames} frames, {res.wav.shape[0]} samples "
          f"({res.wav.shape[0] / sr_out:.2f} s) in {time.perf_counter() - t0:.1f} s -> {out}")
    print(f"agent text: {tokenizer.decode(res.text_tokens.tolist())!r}")


if __name__ == "__main__":
    main()
