"""The model by name: `checkpoint=` takes a directory or a Hugging Face repo id, resolved through
huggingface_hub's cache (nemo_duplex/checkpoint/hub.py). The tests use a hub cache laid out exactly as huggingface_hub
lays out a downloaded snapshot (blobs named by their hash, refs/main, snapshots/<commit>/ of links), holding
the tiny checkpoint under the release's repo id, offline. Without a checkpoint an app stops within seconds
and says what it looked for, where, and the two ways forward."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from nemo_duplex.checkpoint.hub import CheckpointNotFound, is_repo_id, resolve_checkpoint

REPO = Path(__file__).resolve().parent.parent
RELEASE = "nvidia/NVIDIA-NemotronLabs-VoiceChat-11B"
LLM = "nvidia/NVIDIA-Nemotron-Nano-9B-v2"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(cache: Path, repo_id: str, files: dict[str, bytes], commit: str) -> Path:
    """`files` as huggingface_hub stores a snapshot of `repo_id` at `commit` in the cache `cache`: each file's
    bytes once under blobs/ (LFS files by their sha256, others by their git blob sha1), a relative link to it
    under snapshots/<commit>/, and refs/main naming the commit."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    for rel, data in files.items():
        blob = hashlib.sha256(data).hexdigest() if rel.endswith(".safetensors") else git_blob_sha1(data)
        (root / "blobs").mkdir(exist_ok=True)
        (root / "blobs" / blob).write_bytes(data)
        link = root / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(root / "blobs" / blob, link.parent))
    return root / "snapshots" / commit


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """HF_HOME with the tiny checkpoint published as the release: the VoiceChat repository holds config.json
    (pretrained_llm naming the LLM's repo, as the release's does), model.safetensors and rnnt_tokenizer/, no
    LLM tokenizer; the LLM's repository holds tokenizer.json and its HF config.json."""
    from nemo_duplex.checkpoint.random_weights import make_random_checkpoint
    from nemo_duplex.models.config import tiny_config

    made = tmp_path_factory.mktemp("made") / "tiny"
    make_random_checkpoint(tiny_config(), made, seed=0)
    official = json.loads((made / "config.json").read_text())
    official["model"]["stt"]["model"]["pretrained_llm"] = LLM
    del official["random_weights"]   # published as if it were the release
    home = tmp_path_factory.mktemp("hf_home")
    cache = home / "hub"
    add_snapshot(cache, RELEASE, {
        "config.json": json.dumps(official).encode(),
        "model.safetensors": (made / "model.safetensors").read_bytes(),
        "rnnt_tokenizer/vocab.json": (made / "rnnt_tokenizer" / "vocab.json").read_bytes(),
        "rnnt_tokenizer/tokenizer_config.json": (made / "rnnt_tokenizer" / "tokenizer_config.json").read_bytes(),
        "README.md": b"# the tiny model, published under the release's name for the tests\n",
    }, commit="a" * 40)
    add_snapshot(cache, LLM, {
        "tokenizer.json": (made / "tokenizer.json").read_bytes(),
        "config.json": (made / "llm" / "config.json").read_bytes(),
    }, commit="b" * 40)
    return home


def offline_env(home: Path, **extra) -> dict:
    return {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def test_repo_ids_and_directories(tmp_path):
    assert is_repo_id(RELEASE) and is_repo_id("a/b.c-d") and not is_repo_id("outputs/ckpt/tiny")
    assert resolve_checkpoint(str(tmp_path)).path == tmp_path.resolve()
    with pytest.raises(ValueError, match="revision=v1 applies to a Hugging Face repo id"):
        resolve_checkpoint(str(tmp_path), revision="v1")
    with pytest.raises(CheckpointNotFound, match="no such directory, and not a Hugging Face repo id"):
        resolve_checkpoint(str(tmp_path / "a" / "b"))


def test_resolution_through_the_cache_offline(hub_home, monkeypatch):
    # in a fresh process: huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it is imported
    code = ("from nemo_duplex.checkpoint.hub import resolve_checkpoint; s = resolve_checkpoint(%r); "
            "print(s.path, s.repo_id, s.commit)" % RELEASE)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=offline_env(hub_home), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    path, repo, commit = out.stdout.split()
    assert Path(path) == hub_home / "hub" / "models--nvidia--NVIDIA-NemotronLabs-VoiceChat-11B" / "snapshots" / ("a" * 40)
    assert (repo, commit) == (RELEASE, "a" * 40)


def test_serve_the_release_repo_id_from_the_cache_offline(hub_home, tmp_path):
    """`model=nemotron_duplex` with no checkpoint= is the release's repo id; the tiny checkpoint cached under
    it is served offline: its own config.json gives the architecture, the LLM's tokenizer comes from the
    LLM's repository in the cache (the release does not ship it)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "scripts/serve.py", "model=nemotron_duplex", "serve.host=127.0.0.1",
                             f"serve.port={port}", "serve.warmup_frames=1", f"hydra.run.dir={tmp_path}"],
                            cwd=REPO, env=offline_env(hub_home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        health = _wait_health(port, proc)
        assert health["status"] == "ready"
    finally:
        proc.terminate()
        log = proc.communicate(timeout=30)[0]
    assert f"weights: {RELEASE} (snapshot aaaaaaaaaaaa" in log, log
    assert "architecture from the checkpoint's config.json" in log, log
    used = (tmp_path / "settings.yaml").read_text()
    assert f"repo_id: {RELEASE}" in used and "commit: " + "a" * 40 in used and "hidden_size: 96" in used


def test_a_dead_hub_falls_back_to_the_cache_and_downloads_nothing(hub_home, tmp_path):
    # not offline, but the hub's address answers nothing: what the cache holds is used as it is
    blobs = hub_home / "hub" / "models--nvidia--NVIDIA-NemotronLabs-VoiceChat-11B" / "blobs"
    before = {p.name: p.stat().st_mtime_ns for p in blobs.iterdir()}
    env = {**offline_env(hub_home, HF_ENDPOINT=f"http://127.0.0.1:{_free_port()}"), "HF_HUB_OFFLINE": "0"}
    out = subprocess.run([sys.executable, "scripts/run_clip.py", f"checkpoint={RELEASE}", f"out={tmp_path}",
                          f"hydra.run.dir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert (tmp_path / "agent.wav").stat().st_size > 0
    assert {p.name: p.stat().st_mtime_ns for p in blobs.iterdir()} == before


@pytest.mark.parametrize("app", ["scripts/serve.py", "scripts/run_clip.py", "scripts/bench.py", "eval/gate.py"])
def test_no_checkpoint_stops_within_seconds_and_says_what_to_do(tmp_path, app):
    """The users' own command with nothing in the cache and no network: a clear refusal, never a made-up
    model (the old behaviour generated 44 GB of random weights in memory until the kernel killed it)."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, app, "model=nemotron_duplex", f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO,
                         env=offline_env(tmp_path / "empty_home"), capture_output=True, text=True, timeout=60)
    seconds = time.monotonic() - t0
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert seconds < 10, seconds
    for needle in (f"no checkpoint {RELEASE}", str(tmp_path / "empty_home" / "hub"), "HF_HUB_OFFLINE",
                   "checkpoint=<dir or repo id>", "model.weights=random", "speed measurements only"):
        assert needle in text, (needle, text)
    assert "Traceback" not in text, text


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(port: int, proc, timeout: float = 120.0) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}):\n{proc.stdout.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(0.2)
    raise AssertionError("the server did not become ready")


def test_the_fixture_is_laid_out_as_the_hub_lays_it_out(hub_home):
    # what huggingface_hub's own cache scanner makes of it: two repositories, one revision each, every file
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub_home / "hub")
    repos = {r.repo_id: r for r in info.repos}
    assert set(repos) == {RELEASE, LLM} and not info.warnings
    files = {f.file_name for rev in repos[RELEASE].revisions for f in rev.files}
    assert {"config.json", "model.safetensors", "vocab.json"} <= files
