"""scripts/run_clip.py, the README's main command: it runs on the embedded tiny model and writes what the
model said; mode=engine takes the engine settings from the config."""
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_duplex.runtime import SettingsError
from tests.apps import compose_app

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))


def test_engine_mode_takes_the_engine_settings_from_the_config():
    from run_clip import engine_config

    default = compose_app("run_clip", ["mode=engine"])
    invariant = compose_app("run_clip", ["mode=engine", "engine.batch_invariant=true", "engine.max_calls=3"])
    assert engine_config(default, 3).batch_invariant is False
    assert engine_config(default, 5).max_calls == 5   # engine.max_calls=null (the default): a slot per clip
    cfg = engine_config(invariant, 3)
    assert cfg.batch_invariant is True and cfg.max_calls == 3
    with pytest.raises(SettingsError, match="engine.max_calls = 3 is fewer slots"):
        engine_config(invariant, 4)   # never silently more slots than asked for


def test_the_main_command_writes_its_outputs(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "run_clip.py"), f"out={out}",
                           f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("agent.wav", "frames.tsv", "agent.txt", "user.txt"):
        assert (out / name).stat().st_size > 0, name
    rows = (out / "frames.tsv").read_text().splitlines()
    assert rows[0].startswith("frame\ttext_token") and len(rows) == 1 + 75   # the 6 s example clip: 75 frames
