"""Building the server of a composed `serve` config: used by scripts/serve.py in one process and by each
Ray Serve replica (server/replicas.py)."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from nemo_duplex import runtime


def build_server(cfg: DictConfig, overrides: list[str] | None = None):
    """The server of a composed `serve` config: the model (after the memory check of the model and the
    engine's pools), the engine, the server. Prints the settings it runs with and writes them to the run
    directory."""
    resolved = runtime.resolve_model(cfg, overrides)   # a missing checkpoint is refused here, in seconds
    runtime.settle_max_calls(cfg, resolved.cfg, cfg.device)   # engine.max_calls=null: the places the device holds
    engine_cfg = OmegaConf.to_object(cfg.engine)
    # imported only now: a refusal (no checkpoint, bad settings) needs neither torch nor the server
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
        f"engine: {engine_cfg.max_calls} call places of up to {engine_cfg.max_call_s:g} s, "
        f"{engine.step_runner.kind} steps, pipeline {engine_cfg.pipeline}; calls default to seed {cfg.seed}, text "
        f"temperature {sampling.temperature:g}"]), flush=True)
    if (run_dir := runtime.run_dir()) is not None:
        print(f"  settings: {runtime.write_settings(run_dir, cfg, loaded)}", flush=True)
    if mcfg.talker.speaker not in voices:
        raise runtime.SettingsError(f"model.talker.speaker={mcfg.talker.speaker!r}: the checkpoint's voices are "
                                    f"{voices}")
    return Server(engine, tokenizer, rnnt_vocab, serve, model_name=mcfg.name, voices=voices,
                  default_voice=mcfg.talker.speaker, session_defaults=defaults)


def prepare_only(server) -> str:
    """serve.prepare_only: capture (and compile) the engine's steps as a start does, saving the compiled
    back end's work in its compile cache, and serve nothing. -> the line that says what was kept."""
    import time

    t0 = time.perf_counter()
    server.engine.prepare()
    runner = server.engine.step_runner
    took = time.perf_counter() - t0
    if runner.compile_cache is not None:
        kept = f"the compile cache {runner.compile_cache.artifacts} (a start with these settings loads it)"
    else:
        kept = "nothing kept: " + ("engine.compile_cache_dir=null" if runner.compiles else "these steps compile nothing")
    return f"prepared {runner.kind} steps in {took:.0f} s; {kept}; not serving (serve.prepare_only=true)"
