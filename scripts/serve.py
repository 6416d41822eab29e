"""Serve the model: OpenAI Realtime on /v1/realtime, the native protocol on /generate/ws and
POST /generate, /health, /metrics and a browser page on / (docs/protocol.md).

    python scripts/serve.py                                        # embedded tiny model on the CPU
    python scripts/serve.py model=nemotron_duplex checkpoint=<dir> device=cuda   # engine.graphs=auto: captured
    python scripts/serve.py serve.port=9000 serve.max_calls=32 engine.max_calls=32
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_duplex import runtime  # noqa: E402
from nemo_duplex.engine import Engine, EngineConfig  # noqa: E402
from nemo_duplex.server import ServeConfig, Server  # noqa: E402


def check_memory(cfg: DictConfig, serve: ServeConfig, max_calls: int) -> None:
    """Refuse to start, before any weights load, when the state pools of max_calls calls of up to
    serve.max_call_s would not fit (nemo_duplex/memory.py). The budget is memory.device_gib when set,
    else the device's free memory on CUDA; on the CPU there is no check unless device_gib is set."""
    from nemo_duplex.memory import DEFAULT_RESERVE_BYTES, GiB, plan

    m = cfg.get("memory") or {}
    if not m.get("check", True):
        return
    if m.get("device_gib") is not None:
        device_memory = int(float(m.device_gib) * GiB)
    elif torch.device(cfg.device).type == "cuda":
        device_memory = torch.cuda.mem_get_info(torch.device(cfg.device))[0]
    else:
        return
    prompt = int(cfg.engine.get("max_prompt_tokens", EngineConfig.max_prompt_tokens))
    entries = int(cfg.engine.get("prefix_cache_entries", EngineConfig.prefix_cache_entries))
    p = plan(runtime.model_config(cfg), max_calls, serve.max_call_s, device_memory, max_prompt_tokens=prompt,
             reserve=int(float(m.get("reserve_gib", DEFAULT_RESERVE_BYTES / GiB)) * GiB), prefix_cache_entries=entries)
    print(p.summary(), flush=True)


def build_server(cfg: DictConfig) -> Server:
    serve = ServeConfig(**OmegaConf.to_container(cfg.serve, resolve=True))
    check_memory(cfg, serve, max(serve.max_calls, int(cfg.engine.max_calls)))
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

    from nemo_duplex.memory import MemoryPlanError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # The engine thread and the event loop share the GIL; a thread waiting for it gets it after at most
    # this interval. 5 ms (Python's default) per hand-over is a large share of an 80 ms frame under load.
    sys.setswitchinterval(float(cfg.serve.gil_switch_interval_ms) / 1e3)
    try:
        server = build_server(cfg)
    except MemoryPlanError as e:
        raise SystemExit(f"refusing to start: {e}") from None
    print(f"serving {server.model_name} on http://{server.cfg.host}:{server.cfg.port} "
          f"(max_calls={server.cfg.max_calls}, max_call_s={server.cfg.max_call_s:g}); ready after warm-up, "
          f"see /health", flush=True)
    web.run_app(server.app(), host=server.cfg.host, port=server.cfg.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
