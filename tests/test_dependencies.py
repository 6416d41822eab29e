"""Dependencies where they belong: `pip install -e .` serves the model; what the gate, the clip evaluation
and the load test import at run time comes with the extra that the README's command for them installs."""
from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
# what only the extras (and the tests) install
OPTIONAL = ("wandb", "soundfile", "jiwer", "pocketsphinx", "matplotlib", "transformers", "openai", "pytest", "ray")

RUN_WITHOUT = """
import runpy, sys
blocked = set(sys.argv[1].split(","))
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ImportError(f"{name} is not installed here")
sys.meta_path.insert(0, Blocked())
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def without_extras(*argv: str) -> list[str]:
    return [sys.executable, "-c", RUN_WITHOUT, ",".join(OPTIONAL), *argv]


def test_the_extras_hold_what_the_evaluation_imports():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    for name in ("wandb", "soundfile", "jiwer", "pocketsphinx", "matplotlib"):
        assert name in " ".join(extras["eval"]) and name not in base, name
    assert {"matplotlib", "wandb"} <= set(extras["bench"])
    assert any(d.startswith("ray[serve]") for d in extras["cluster"]) and "ray" not in base
    assert "nemo-duplex[eval,bench,cluster]" in extras["dev"]


def test_replicas_without_ray_name_the_extra(tmp_path):
    """serve.replicas > 1 needs Ray Serve (the `cluster` extra): without it the refusal says how to get it."""
    done = subprocess.run(without_extras("scripts/serve.py", "serve.replicas=2", f"hydra.run.dir={tmp_path}"),
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "pip install -e '.[cluster]'" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_the_main_command_runs_without_the_extras(tmp_path):
    done = subprocess.run(without_extras("scripts/run_clip.py", f"out={tmp_path}", f"hydra.run.dir={tmp_path}"),
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (tmp_path / "agent.wav").stat().st_size > 0


@contextlib.contextmanager
def served_without_extras(tmp_path):
    """scripts/serve.py (tiny model, CPU) without the extras, ready: (port, process); killed after if still up."""
    from tests.test_hub import _free_port, _wait_health

    port = _free_port()
    proc = subprocess.Popen(without_extras("scripts/serve.py", "serve.host=127.0.0.1", f"serve.port={port}",
                                           "serve.warmup_frames=1", f"hydra.run.dir={tmp_path}"),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert _wait_health(port, proc)["status"] == "ready"
        yield port, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


def test_the_server_serves_without_the_extras(tmp_path):
    with served_without_extras(tmp_path) as (port, proc):
        pcm = (0.1 * np.random.default_rng(0).standard_normal(12800) * 32767).astype("<i2").tobytes()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=_wav(pcm),
                                     headers={"Content-Type": "audio/wav"})
        with urllib.request.urlopen(req, timeout=120) as r:
            lines = [json.loads(x) for x in r.read().decode().splitlines()]
        frames = [x for x in lines if x["type"] == "audio"]
        assert len(frames) == 10 and len(base64.b64decode(frames[0]["pcm16"])) == 2 * 1764
        assert lines[-1] == {"type": "ended", "reason": "completed"}
        proc.terminate()                        # SIGTERM: the server drains and exits 0
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out[-3000:]


def _wav(pcm16: bytes, rate: int = 16000) -> bytes:
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm16)
    return buf.getvalue()


def test_ctrl_c_stops_the_server_with_status_0_and_no_traceback(tmp_path):
    """SIGINT (Ctrl-C at the terminal) drains and exits 0, as SIGTERM does; uvicorn raised it again after its
    shutdown, which printed a KeyboardInterrupt traceback and exited 130."""
    import signal

    with served_without_extras(tmp_path) as (_, proc):
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
