"""Serve the model: OpenAI Realtime on /v1/realtime, the native protocol on /generate/ws and
POST /generate, /health, /metrics and a browser page on / (docs/protocol.md). `--help` lists the options.

    python scripts/serve.py                                        # embedded tiny model on the CPU
    python scripts/serve.py model=nemotron_duplex device=cuda model/dtype=bf16   # the release checkpoint (HF)
    python scripts/serve.py checkpoint=<dir or repo id> device=cuda engine.max_calls=128
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_duplex import runtime, settings  # noqa: E402

settings.register()


def build_server(cfg: DictConfig, overrides: list[str] | None = None):
    """The server of a composed `serve` config: the model (after the memory check of the model and the
    engine's pools), the engine, the server. Prints the settings it runs with and writes them to the run
    directory."""
    engine_cfg = OmegaConf.to_object(cfg.engine)
    resolved = runtime.resolve_model(cfg, overrides)   # a missing checkpoint is refused here, in seconds
    # imported only now: `--help` and a refusal (no checkpoint, bad settings) need neither torch nor the server
    from nemo_duplex.server.app import Server
    from nemo_duplex.server.realtime_protocol import SessionSettings
    from nemo_duplex.serving.engine import build_engine

    loaded = runtime.load(cfg, resolved=resolved, calls=(engine_cfg.max_calls, engine_cfg.max_call_s))
    model, tokenizer, rnnt_vocab, mcfg = loaded
    serve = OmegaConf.to_object(cfg.serve)
    sampling = OmegaConf.to_object(cfg.sampling)
    defaults = SessionSettings(seed=int(cfg.seed), temperature=sampling.temperature, top_p=sampling.top_p,
                               repetition_penalty=sampling.repetition_penalty)
    engine = build_engine(model, tokenizer, engine_cfg)
    voices = sorted(model.tts_model.audio_prompt_latents.keys())
    print(runtime.summary(cfg, loaded, "serve", [
        f"engine: {engine_cfg.max_calls} call places of up to {engine_cfg.max_call_s:g} s, graphs "
        f"{engine_cfg.graphs}, pipeline {engine_cfg.pipeline}; calls default to seed {cfg.seed}, text "
        f"temperature {sampling.temperature:g}"]), flush=True)
    if (run_dir := runtime.run_dir()) is not None:
        print(f"  settings: {runtime.write_settings(run_dir, cfg, loaded)}", flush=True)
    if mcfg.talker.speaker not in voices:
        raise runtime.SettingsError(f"model.talker.speaker={mcfg.talker.speaker!r}: the checkpoint's voices are "
                                    f"{voices}")
    return Server(engine, tokenizer, rnnt_vocab, serve, model_name=mcfg.name, voices=voices,
                  default_voice=mcfg.talker.speaker, session_defaults=defaults)


@hydra.main(config_path="../conf", config_name="serve", version_base=None)
def main(cfg: DictConfig) -> None:
    from nemo_duplex.server.app import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # The engine thread and the event loop share the GIL; a thread waiting for it gets it after at most
    # this interval. 5 ms (Python's default) per hand-over is a large share of an 80 ms frame under load.
    sys.setswitchinterval(float(cfg.serve.gil_switch_interval_ms) / 1e3)
    with runtime.refusals("serve"):
        server = build_server(cfg)
    print(f"serving {server.model_name} on http://{server.cfg.host}:{server.cfg.port} "
          f"(engine.max_calls={server.max_calls}, engine.max_call_s={server.max_call_s:g}); ready after warm-up, "
          f"see /health", flush=True)
    serve(server)


if __name__ == "__main__":
    main()
