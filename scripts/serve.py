"""Serve the model: OpenAI Realtime on /v1/realtime, the native protocol on /generate/ws and
POST /generate, /health, /metrics and a browser page on / (docs/protocol.md).

    python scripts/serve.py                                        # embedded tiny model on the CPU
    python scripts/serve.py model=nemotron_duplex checkpoint=<dir> device=cuda engine.graphs=true
    python scripts/serve.py serve.port=9000 serve.max_calls=32 engine.max_calls=32
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_duplex import runtime  # noqa: E402
from nemo_duplex.engine import Engine, EngineConfig  # noqa: E402
from nemo_duplex.server import ServeConfig, Server  # noqa: E402


def build_server(cfg: DictConfig) -> Server:
    serve = ServeConfig(**OmegaConf.to_container(cfg.serve, resolve=True))
    model, tokenizer, rnnt_vocab, mcfg = runtime.load(cfg)
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    engine_kwargs = {k: v for k, v in OmegaConf.to_container(cfg.engine, resolve=True).items() if k in known}
    # the server's limits are the engine's: one source of truth for slots, call length and input budget
    engine_kwargs.update(max_calls=max(serve.max_calls, engine_kwargs.get("max_calls", 0)),
                         max_call_s=serve.max_call_s, max_pending_s=serve.max_pending_s)
    engine = Engine(model, tokenizer, EngineConfig(**engine_kwargs))
    voices = sorted(model.tts_model.audio_prompt_latents.keys())
    return Server(engine, tokenizer, rnnt_vocab, serve, model_name=mcfg.name, voices=voices,
                  default_voice=mcfg.talker.speaker if mcfg.talker.speaker in voices else voices[0])


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from aiohttp import web

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = build_server(cfg)
    print(f"serving {server.model_name} on http://{server.cfg.host}:{server.cfg.port} "
          f"(max_calls={server.cfg.max_calls}, max_call_s={server.cfg.max_call_s:g}); ready after warm-up, "
          f"see /health", flush=True)
    web.run_app(server.app(), host=server.cfg.host, port=server.cfg.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
