"""One source of truth for settings (nemo_duplex/runtime.py): the checkpoint's config.json gives the
architecture, which the command line cannot contradict, and the default generation settings, over which
the command line wins; an app prints and records the settings it ran with."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from nemo_duplex.models.config import tiny_config
from nemo_duplex.runtime import SettingsError, explicit_keys, merge_checkpoint_settings, resolve_model
from tests.apps import compose_app

REPO = Path(__file__).resolve().parent.parent


def resolve(app, overrides):
    return resolve_model(compose_app(app, overrides), overrides)


def test_explicit_keys_are_the_command_lines_model_keys():
    given = ["model=nemotron_duplex", "model/dtype=bf16", "model.talker.noise_scale=0", "+model.x=1",
             "engine.pipeline=1", "device=cuda"]
    assert explicit_keys(given) == {"talker.noise_scale", "x"}
    assert explicit_keys(given, "engine.") == {"pipeline"}


def test_generation_settings_from_the_command_line_win_and_the_checkpoint_gives_the_rest(caplog):
    preset = tiny_config()
    ckpt = replace(preset, talker=replace(preset.talker, noise_scale=0.5, guidance_scale=0.7, top_p=0.8))
    asked = replace(preset, talker=replace(preset.talker, noise_scale=0.0, top_k=1))
    merged = merge_checkpoint_settings(asked, ckpt, {"talker.noise_scale", "talker.top_k"})
    t = merged.cfg.talker
    assert (t.noise_scale, t.top_k) == (0.0, 1)             # the command line's
    assert t.guidance_scale == 0.7                          # the checkpoint's default
    # top_p and top_k are one choice (inference_top_p_or_k): giving top_k keeps the checkpoint's top_p out of it
    assert t.top_p == 0.95
    assert merged.from_command_line == {"talker.noise_scale": (0.0, 0.5), "talker.top_k": (1, 0),
                                        "talker.top_p": (0.95, 0.8)}
    merged = merge_checkpoint_settings(replace(preset, talker=replace(preset.talker, top_p=0.5)), ckpt,
                                       {"talker.top_p"})
    assert merged.cfg.talker.top_p == 0.5 and merged.cfg.talker.noise_scale == 0.5


def test_a_preset_generation_value_the_checkpoint_replaces_is_named():
    preset = tiny_config()
    mine = replace(preset, talker=replace(preset.talker, noise_scale=0.25))   # as a preset YAML might set it
    merged = merge_checkpoint_settings(mine, preset, set())
    assert merged.cfg.talker.noise_scale == preset.talker.noise_scale
    assert merged.replaced == {"talker.noise_scale": (0.25, preset.talker.noise_scale)}


def test_the_command_line_cannot_contradict_the_checkpoints_architecture(tiny_checkpoint):
    with pytest.raises(SettingsError) as e:
        resolve("run_clip", [f"checkpoint={tiny_checkpoint}", "model.llm.hidden_size=128",
                             "model.encoder.n_layers=2"])
    msg = str(e.value)
    assert "model.llm.hidden_size=128 on the command line, but the checkpoint's config.json says 96" in msg
    assert "n_layers" not in msg   # the same value as the checkpoint's is no contradiction
    # the release preset over the tiny checkpoint: its dimensions are the preset's, not the command line's
    r = resolve("run_clip", ["model=nemotron_duplex", f"checkpoint={tiny_checkpoint}"])
    assert r.cfg.llm.hidden_size == 96 and "architecture from the checkpoint's config.json" in r.notes[-1]


def test_random_weights_with_a_checkpoint_is_refused(tiny_checkpoint):
    with pytest.raises(SettingsError, match="random weights load no checkpoint"):
        resolve("run_clip", ["model.weights=random", f"checkpoint={tiny_checkpoint}"])


def test_a_preset_value_the_checkpoint_replaces_is_warned_about(tiny_checkpoint, caplog, monkeypatch):
    import nemo_duplex.runtime as runtime

    real = runtime.model_config
    monkeypatch.setattr(runtime, "model_config", lambda cfg: replace(
        real(cfg), talker=replace(real(cfg).talker, guidance_scale=0.9)))   # a preset that sets it
    with caplog.at_level(logging.WARNING, logger="nemo_duplex"):
        r = resolve("run_clip", [f"checkpoint={tiny_checkpoint}"])
    assert r.cfg.talker.guidance_scale == 0.2
    assert "model.talker.guidance_scale: the preset's 0.9 is replaced by the checkpoint's 0.2" in caplog.text


def _run_clip(tmp_path, name, clip, *overrides):
    out = tmp_path / name
    done = subprocess.run([sys.executable, "scripts/run_clip.py", "mode=streaming", f"clip={clip}", f"out={out}",
                           f"dump={out}.safetensors", *overrides, f"hydra.run.dir={out}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    from safetensors.numpy import load_file

    return load_file(f"{out}.safetensors"), done.stdout, (out / "settings.yaml").read_text()


def test_the_noise_free_talker_on_the_command_line_equals_it_in_config_json(tmp_path, tiny_checkpoint):
    """`model.talker.noise_scale=0 model.talker.top_k=1` with a checkpoint whose config.json says noise 0.001 and
    top-p 0.95 gives the codes of the same checkpoint with those settings written into its config.json, and
    not the codes of its own defaults."""
    from nemo_duplex.audio import write_wav

    clip = tmp_path / "clip.wav"
    write_wav(clip, 0.1 * np.random.default_rng(0).standard_normal(16000).astype(np.float32), 16000)
    noise_free = tmp_path / "noise_free"
    shutil.copytree(tiny_checkpoint, noise_free)
    official = json.loads((noise_free / "config.json").read_text())
    gen = official["model"]["speech_generation"]["model"]
    assert (gen["inference_noise_scale"], gen["inference_top_p_or_k"]) == (0.001, 0.95)
    gen["inference_noise_scale"], gen["inference_top_p_or_k"] = 0.0, 1
    (noise_free / "config.json").write_text(json.dumps(official))

    cli, log, used = _run_clip(tmp_path, "cli", clip, f"checkpoint={tiny_checkpoint}", "model.talker.noise_scale=0",
                               "model.talker.top_k=1")
    written, _, _ = _run_clip(tmp_path, "written", clip, f"checkpoint={noise_free}")
    default, _, _ = _run_clip(tmp_path, "default", clip, f"checkpoint={tiny_checkpoint}")
    np.testing.assert_array_equal(cli["codes"], written["codes"])
    assert not np.array_equal(cli["codes"], default["codes"])
    # what the run says and records it ran with
    assert "model.talker.noise_scale=0.0 (checkpoint: 0.001)" in log and "top-k 1" in log, log
    assert "noise_scale: 0.0" in used and "top_k: 1" in used and "talker.noise_scale: 0.0" in used
