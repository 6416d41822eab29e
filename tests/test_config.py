"""The settings schema: presets over the dataclass defaults, every entry point's config composes, unknown keys
and wrong types are refused, `--help` says what each app does; derived quantities of the spec."""
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from nemo_duplex.models.config import DtypeConfig, ModelConfig, preset, tiny_config
from tests.apps import APPS, REPO, compose_app

ENTRY_POINTS = {"serve": "scripts/serve.py", "run_clip": "scripts/run_clip.py",
                "make_checkpoint": "scripts/make_checkpoint.py", "bench_step": "scripts/bench_step.py",
                "bench": "scripts/bench.py", "profile_step": "scripts/dev/profile_step.py", "gate": "eval/gate.py",
                "eval_clips": "eval/clips.py"}


def test_the_release_preset_is_the_dataclass_defaults():
    assert preset("nemotron_duplex") == ModelConfig()
    assert ModelConfig().default_checkpoint == "nvidia/NVIDIA-NemotronLabs-VoiceChat-11B"
    assert tiny_config().default_checkpoint == "embedded"


def test_tiny_has_every_kind_of_layer():
    c = tiny_config()
    assert set(c.llm.hybrid_override_pattern) == {"M", "*", "-"}
    kinds = {c.talker.backbone.is_full_attention(i) for i in range(c.talker.backbone.num_hidden_layers)}
    assert kinds == {True, False}
    assert c.talker.num_quantizers == 31 and c.samples_per_frame_out == 1764


def test_spec_derived_numbers():
    c = ModelConfig()
    assert c.talker.unmask_schedule() == [0, 0, 0, 1, 1, 3, 4, 22]     # spec 4.6
    assert c.prompt_frames == 37 and c.samples_per_frame_in == 1280     # spec 4.3, 1.2
    assert c.llm.layer_indices("*") == [14, 21, 30, 39] and len(c.llm.layer_indices("M")) == 27  # spec 3.2
    assert c.llm.mamba_d_inner == 10240 and c.llm.mamba_conv_dim == 12288                   # spec 3.3


def test_config_errors_are_clear(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="codec must be fp32"):
        DtypeConfig(codec="bf16")
    with pytest.raises(ValueError, match="dtype.talker_kv: unknown dtype 'fp9'"):
        DtypeConfig(talker_kv="fp9")
    with pytest.raises(ValueError, match="no model preset 'nope'"):
        preset("nope")


@pytest.mark.parametrize("app", APPS)
def test_every_entry_point_composes_to_its_schema(app):
    cfg = compose_app(app)
    obj = OmegaConf.to_object(cfg)          # every value has the schema's type
    assert OmegaConf.is_missing(cfg, "model") is False and type(obj.model) is ModelConfig
    assert obj.model.name == tiny_config().name   # the tiny preset is the default everywhere
    assert obj.model.llm == tiny_config().llm


def test_unknown_keys_and_wrong_types_are_refused():
    with pytest.raises(ConfigCompositionException, match="engine.coalesce_msec"):
        compose_app("serve", ["engine.coalesce_msec=3"])
    with pytest.raises(ConfigCompositionException, match="max_calls"):
        compose_app("serve", ["serve.max_calls=4"])        # the call places are engine.max_calls: one key
    with pytest.raises(ConfigCompositionException, match="serve"):
        compose_app("run_clip", ["serve.port=9"])          # run_clip has no server: no serve.* to ignore
    with pytest.raises(ConfigCompositionException, match="device"):
        compose_app("make_checkpoint", ["device=cuda"])    # make_checkpoint writes from the CPU
    with pytest.raises(ConfigCompositionException, match="engine.max_calls"):
        compose_app("serve", ["engine.max_calls=many"])
    with pytest.raises(ConfigCompositionException, match="model.llm.hidden"):
        compose_app("serve", ["model.llm.hidden=3"])


def test_dtype_presets():
    bf16 = compose_app("serve", ["model/dtype=bf16"]).model.dtype
    assert (bf16.encoder, bf16.llm, bf16.talker, bf16.codec, bf16.mamba_ssm_state) == ("bf16",) * 3 + ("fp32",) * 2
    assert compose_app("serve").model.dtype.llm == "fp32"            # on the CPU (model/dtype=auto): the reference
    assert compose_app("bench_step").model.dtype.llm == "bf16"       # the benchmark times the deployment
    assert compose_app("bench_step", ["model/dtype=fp32"]).model.dtype.llm == "fp32"
    assert compose_app("serve", ["model/dtype=bf16", "model.dtype.talker=fp32"]).model.dtype.talker == "fp32"
    assert bf16.talker_kv is None
    capacity = OmegaConf.to_object(compose_app("serve", ["model/dtype=capacity"]).model).dtype
    assert (capacity.llm, capacity.mamba_ssm_state, capacity.talker_kv, capacity.talker_kv_pool) == \
        ("bf16", "bf16", "fp8", "fp8")


def test_the_default_device_is_the_gpu_when_there_is_one_and_auto_dtypes_follow_it(monkeypatch):
    """`python scripts/serve.py model=nemotron_duplex` serves the deployment on a GPU machine: the device defaults
    to cuda there (cpu elsewhere) and model/dtype=auto gives bf16 for the encoder, LLM and talker on a GPU (the
    codec and the SSM state fp32), fp32 everywhere on the CPU. A device or dtype given wins."""
    import torch

    def parts(cfg):
        d = OmegaConf.to_object(cfg.model).dtype
        return cfg.device, (d.encoder, d.llm, d.talker, d.codec, d.mamba_ssm_state)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parts(compose_app("serve", ["model=nemotron_duplex"])) == ("cpu", ("fp32",) * 5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for app in ("serve", "run_clip", "gate", "eval_clips", "bench"):
        assert parts(compose_app(app, ["model=nemotron_duplex"])) == ("cuda", ("bf16",) * 3 + ("fp32",) * 2), app
    assert parts(compose_app("serve", ["device=cpu"])) == ("cpu", ("fp32",) * 5)
    assert parts(compose_app("serve", ["device=cuda:1"])) == ("cuda:1", ("bf16",) * 3 + ("fp32",) * 2)
    assert parts(compose_app("serve", ["model/dtype=fp32"])) == ("cuda", ("fp32",) * 5)
    assert parts(compose_app("serve", ["model/dtype=auto", "model.dtype.talker=fp32"]))[1][2] == "fp32"
    # make_checkpoint takes no device: its dtypes are fixed, and its config resolves without one
    assert OmegaConf.to_object(compose_app("make_checkpoint").model).dtype.llm == "fp32"


def test_checkpoint_defaults_to_the_presets():
    assert compose_app("serve").checkpoint == "embedded"
    assert compose_app("serve", ["model=nemotron_duplex"]).checkpoint == "nvidia/NVIDIA-NemotronLabs-VoiceChat-11B"
    assert compose_app("serve", ["model=nemotron_duplex", "checkpoint=/x"]).checkpoint == "/x"


def _help_text(app: str, overrides=()) -> str:
    """What `--help` prints: Hydra's app help template, resolved against the composed config (the template
    holds no $FLAGS_HELP-style fields: `$$` is its only escape)."""
    import string

    from hydra import compose, initialize_config_dir

    compose_app(app)   # registers the schemas
    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        cfg = compose(app, overrides=list(overrides), return_hydra_config=True)
    return string.Template(cfg.hydra.help.template).substitute()


@pytest.mark.parametrize("app", APPS)
def test_help_says_what_each_entry_point_does(app):
    out = _help_text(app, ["engine.max_calls=37"] if app == "serve" else [])
    lines = out.strip().splitlines()
    assert len(lines) <= 60, len(lines)
    assert lines[0].startswith(f"{Path(ENTRY_POINTS[app]).name}: "), lines[0]   # what it does, first
    assert "Usage:" in out and "Example" in out and "--cfg job" in out
    if app == "serve":
        assert "engine.max_calls=N           37" in out   # the current value, with the override


def test_help_is_what_the_script_prints():
    out = subprocess.run([sys.executable, str(REPO / "scripts/serve.py"), "engine.max_calls=37", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == _help_text("serve", ["engine.max_calls=37"]).strip()


def test_prepare_only_builds_the_engine_and_serves_nothing(tmp_path):
    """serve.prepare_only=true (tiny model, CPU): the model and engine are built and prepared, the line says what
    was kept (here nothing: eager steps compile nothing), and the process exits 0 without serving; with
    replicas it is refused, naming the setting."""
    run = [sys.executable, str(REPO / "scripts/serve.py"), "serve.port=9", f"hydra.run.dir={tmp_path}"]
    out = subprocess.run(run + ["serve.prepare_only=true"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "prepared eager steps in" in out.stdout and "nothing kept: these steps compile nothing" in out.stdout
    assert "not serving (serve.prepare_only=true)" in out.stdout and "serving nemotron" not in out.stdout
    refused = subprocess.run(run + ["serve.prepare_only=true", "serve.replicas=2"], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0 and "serve.prepare_only prepares one engine" in refused.stderr, refused.stderr[-2000:]


def test_prepare_only_names_the_compile_cache_it_filled(tmp_path):
    """What serve.prepare_only reports for a compiled step: the artifacts file its start saved (the engine here
    is a stand-in whose prepare() records that it ran; the filling itself is tests/test_compile_cache.py's)."""
    from types import SimpleNamespace

    from graphs.compile_cache import CompileCache
    from nemo_duplex.server.build import prepare_only

    cache = CompileCache(tmp_path, "k")
    prepared = []
    runner = SimpleNamespace(compile_cache=cache, kind="cudagraph", compiles=True)
    engine = SimpleNamespace(step_runner=runner, prepare=lambda: prepared.append(True))
    line = prepare_only(SimpleNamespace(engine=engine))
    assert prepared == [True]
    assert line.startswith("prepared cudagraph steps in") and str(cache.artifacts) in line
    runner.compile_cache = None
    assert "nothing kept: engine.compile_cache_dir=null" in prepare_only(SimpleNamespace(engine=engine))
