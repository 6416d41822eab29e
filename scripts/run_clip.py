"""Run 16 kHz mono clips through the model and write what it says.

    python scripts/run_clip.py                                  # embedded tiny model, example clip
    python scripts/run_clip.py model=nemotron_duplex checkpoint=<dir> clip=a.wav mode=streaming
    python scripts/run_clip.py mode=engine clips=[a.wav,b.wav] offsets=[0,7]
    python scripts/run_clip.py mode=engine clips=[a.wav,b.wav] engine.batch_invariant=true   # bits as if alone

mode=offline is NVIDIA's offline_inference (spec 7.1); mode=streaming the per-frame cached loop
(spec 7.2); mode=engine the batched engine, several clips at once, each with its own start frame and
seed (seed + index). Writes agent.wav (22.05 kHz), frames.tsv (per-frame text and function tokens),
agent.txt, user.txt, settings.yaml and, with dump=<file.safetensors>, the named tensors. `--help` lists
the options.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_duplex import runtime, settings  # noqa: E402
from nemo_duplex.audio import read_wav, write_wav  # noqa: E402
from nemo_duplex.serving.drive import clip_plans, drive

EXAMPLE_CLIP = runtime.REPO / "eval" / "clips" / "example.wav"
MODES = ("offline", "streaming", "engine")
settings.register()


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
    """mode=engine's engine: the `engine` settings, with at least a slot per clip (engine.max_calls smaller
    than the clip count is an error, not a silent change; null, the default, is a slot per clip)."""
    ecfg = OmegaConf.to_object(cfg.engine)
    if ecfg.max_calls is None:
        return dataclasses.replace(ecfg, max_calls=n_clips)
    if ecfg.max_calls < n_clips:
        raise runtime.SettingsError(f"mode=engine runs {n_clips} clips at once; engine.max_calls = {ecfg.max_calls} "
                                    "is fewer slots (raise it)")
    return ecfg


def run_engine(model, tokenizer, engine_cfg, cfg, clips, offsets, prompt, sampling):
    from nemo_duplex.serving.engine import build_engine

    engine = build_engine(model, tokenizer, engine_cfg)
    return drive(engine, clip_plans(clips, offsets=offsets, prompt=prompt, seed=int(cfg.seed), sampling=sampling))


def check_settings(cfg) -> None:
    """Settings of one mode given to another would be ignored: refused instead."""
    if cfg.mode not in MODES:
        raise runtime.SettingsError(f"mode must be one of {MODES}, got {cfg.mode!r}")
    if cfg.mode != "engine" and (cfg.clips is not None or cfg.offsets is not None):
        raise runtime.SettingsError(f"clips= and offsets= are for mode=engine (mode={cfg.mode} runs clip=)")
    if cfg.mode == "engine" and cfg.clips is not None and cfg.clip is not None:
        raise runtime.SettingsError("mode=engine takes clips=[...]; clip= as well would be ignored")
    if cfg.mode == "engine" and cfg.dump is not None:
        raise runtime.SettingsError("dump= writes one clip's tensors: mode=offline or mode=streaming")
    engine_keys = sorted(runtime.explicit_keys(runtime.cli_overrides(), "engine."))
    if cfg.mode != "engine" and engine_keys:
        raise runtime.SettingsError(f"engine.{', engine.'.join(engine_keys)}: engine settings apply to mode=engine "
                                    f"only (mode={cfg.mode})")


@hydra.main(config_path="../conf", config_name="run_clip", version_base=None)
def main(cfg: DictConfig) -> None:
    from nemo_duplex.models.model import offline_inference
    from nemo_duplex.serving.frame_step import stream_inference

    out = Path(cfg.out) if cfg.get("out") else runtime.run_dir()
    paths = list(cfg.clips) if cfg.clips else [cfg.clip or EXAMPLE_CLIP]
    with runtime.refusals("run_clip"):
        check_settings(cfg)
        engine_cfg = engine_config(cfg, len(paths)) if cfg.mode == "engine" else None
        loaded = runtime.load(cfg, calls=(engine_cfg.max_calls, engine_cfg.max_call_s) if engine_cfg else None)
    model, tokenizer, rnnt_vocab, mcfg = loaded
    print(runtime.summary(cfg, loaded, f"run_clip (mode={cfg.mode})"), flush=True)
    print(f"  settings: {runtime.write_settings(out, cfg, loaded)}", flush=True)
    sr_in, sr_out = mcfg.source_sample_rate, mcfg.target_sample_rate
    sampling = OmegaConf.to_object(cfg.sampling)
    prompt_ids = model.prompt_ids(tokenizer, cfg.prompt)

    if cfg.mode == "engine":
        clips = [torch.from_numpy(read_wav(p, sr_in)) for p in paths]
        offsets = list(cfg.offsets) if cfg.get("offsets") else [0] * len(clips)
        t0 = time.perf_counter()
        results = run_engine(model, tokenizer, engine_cfg, cfg, clips, offsets, cfg.prompt, sampling)
        for i, (p, res) in enumerate(zip(paths, results)):
            write_outputs(out / f"{i:02d}_{Path(p).stem}", res, tokenizer, rnnt_vocab, sr_out)
        print(f"engine: {len(clips)} clips in {time.perf_counter() - t0:.1f} s -> {out}")
        return

    path = paths[0]
    audio = torch.from_numpy(read_wav(path, sr_in))
    t0 = time.perf_counter()
    if cfg.mode == "offline":
        res = offline_inference(model, audio, prompt_ids, seed=int(cfg.seed), sampling=sampling)
    else:
        res = stream_inference(model, audio, prompt_ids, seed=int(cfg.seed), sampling=sampling)
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
