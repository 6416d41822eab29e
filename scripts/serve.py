"""Serve the model: OpenAI Realtime on /v1/realtime, the native protocol on /generate/ws and
POST /generate, /health, /metrics and a browser page on / (docs/protocol.md). `--help` lists the options.

    python scripts/serve.py                                        # embedded tiny model on the CPU
    python scripts/serve.py model=nemotron_duplex device=cuda model/dtype=bf16   # the release checkpoint (HF)
    python scripts/serve.py checkpoint=<dir or repo id> device=cuda engine.max_calls=128
    python scripts/serve.py model=nemotron_duplex device=cuda serve.replicas=4   # 4 GPUs, Ray Serve (docs/deploy.md)
    python scripts/serve.py model=nemotron_duplex serve.prepare_only=true  # compile into the cache, then exit
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_duplex import runtime, settings  # noqa: E402

settings.register()


@hydra.main(config_path="../conf", config_name="serve", version_base=None)
def main(cfg: DictConfig) -> None:
    from nemo_duplex.server.app import serve
    from nemo_duplex.server.build import build_server, prepare_only

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # The engine thread and the event loop share the GIL; a thread waiting for it gets it after at most
    # this interval. 5 ms (Python's default) per hand-over is a large share of an 80 ms frame under load.
    sys.setswitchinterval(float(cfg.serve.gil_switch_interval_ms) / 1e3)
    if cfg.serve.replicas < 1:
        raise SystemExit(f"serve: serve.replicas={cfg.serve.replicas}: at least 1")
    if cfg.serve.replicas > 1 or cfg.serve.ray_address is not None:
        if cfg.serve.prepare_only:   # one engine fills the cache that every replica of the same GPU kind loads
            raise SystemExit("serve: serve.prepare_only prepares one engine: run it with serve.replicas=1 and no "
                             "serve.ray_address; the replicas then load its compile cache")
        from nemo_duplex.server import replicas
        with runtime.refusals("serve"):
            return replicas.run(cfg, runtime.cli_overrides())
    with runtime.refusals("serve"):
        server = build_server(cfg)
    if cfg.serve.prepare_only:
        print(prepare_only(server), flush=True)
        return
    print(f"serving {server.model_name} on http://{server.cfg.host}:{server.cfg.port} "
          f"(engine.max_calls={server.max_calls}, engine.max_call_s={server.max_call_s:g}); ready after warm-up, "
          f"see /health", flush=True)
    serve(server)


if __name__ == "__main__":
    main()
