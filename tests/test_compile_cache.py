"""The compiled back ends' persistent cache (graphs/compile_cache.py, engine.compile_cache_dir)."""
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from graphs.compile_cache import AOT_CACHE_LOGGER, STREAM_LOOKUP, aot_cache_bypasses, cache_key, compile_counters
from nemo_duplex import REPO
from nemo_duplex.serving.runner import engine_compile_cache
from nemo_duplex.settings import EngineConfig

COMPILE = textwrap.dedent("""
    import json, sys
    import torch
    from graphs.compile_cache import CompileCache, compile_counters

    cache = CompileCache(sys.argv[1], "k")
    cache.activate()
    stream = torch.Stream(device="cpu")

    def step(x):   # a graph that reaches a stream, as the hand-run step's graphs do (STREAM_LOOKUP)
        stream.synchronize()
        return ((x.sin() * 2 + 1).relu() * x.cos()).sum(-1)
    f = torch.compile(step, fullgraph=True, dynamic=False)
    y = f(torch.linspace(-3, 3, 64).view(8, 8))
    cache.save()
    print(json.dumps(dict(compile_counters(), loaded=cache.loaded, y=y.tolist())))
""")


def _compile_in_a_fresh_process(directory: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", COMPILE, str(directory)], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_artifacts_make_a_fresh_machine_skip_the_compile(tmp_path):
    """A process compiles into an empty cache (a miss) and saves its artifacts; a second process with an
    empty cache directory of its own but that artifacts file (a fresh machine given the file) loads it and
    compiles nothing (hits only: Inductor's and AOTAutograd's caches), with the same result. The graph
    reaches a stream: without CompileCache's mark of STREAM_LOOKUP AOTAutograd's cache bypasses it (the
    next test)."""
    first = _compile_in_a_fresh_process(tmp_path / "a")
    assert first["fxgraph_cache_miss"] >= 1 and first["fxgraph_cache_hit"] == 0 and not first["loaded"]
    assert first["autograd_cache_miss"] >= 1 and first["autograd_cache_hit"] == 0
    artifacts = tmp_path / "a" / "artifacts-k.bin"
    assert artifacts.stat().st_size > 0
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "artifacts-k.bin").write_bytes(artifacts.read_bytes())
    second = _compile_in_a_fresh_process(tmp_path / "b")
    assert second["loaded"] and second["fxgraph_cache_hit"] >= 1 and second["fxgraph_cache_miss"] == 0
    assert second["autograd_cache_hit"] >= 1 and second["autograd_cache_miss"] == 0
    assert first["autograd_cache_bypass"] == second["autograd_cache_bypass"] == 0
    assert second["y"] == first["y"]


def test_aot_cache_bypasses_are_caught_with_their_reason(tmp_path, monkeypatch):
    """A build AOTAutograd's cache refuses (here: Inductor's freezing on, one of its refusals) is counted and
    its reason caught from torch's log record, which is not passed on to torch's own handlers; a build it
    takes gives no reason."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    before = compile_counters()
    logger = logging.getLogger(AOT_CACHE_LOGGER)
    level, propagate = logger.level, logger.propagate
    with torch._inductor.config.patch(fx_graph_cache=True, freezing=True), aot_cache_bypasses() as reasons:
        torch.compile(lambda x: x.sin() + 1, fullgraph=True, dynamic=False)(torch.ones(4))
    assert any("freezing" in r for r in reasons), reasons
    assert compile_counters()["autograd_cache_bypass"] == before["autograd_cache_bypass"] + 1
    assert (logger.level, logger.propagate) == (level, propagate)   # the logger is given back as it was
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=True), aot_cache_bypasses() as reasons:
        torch.compile(lambda x: x.cos() * 3, fullgraph=True, dynamic=False)(torch.ones(4))
    assert reasons == []
    assert compile_counters()["autograd_cache_bypass"] == before["autograd_cache_bypass"] + 1


def test_a_graph_reaching_a_stream_bypasses_aot_cache_unless_marked(tmp_path, monkeypatch):
    """What the mark in CompileCache.activate is for: the same kind of graph, with Inductor's cache on but
    without the mark, is refused by AOTAutograd's cache, naming the function."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    stream = torch.Stream(device="cpu")

    def step(x):
        stream.synchronize()
        return x.sin() * 2
    torch._dynamo.reset()
    marked = dict(torch._inductor.config.unsafe_marked_cacheable_functions)
    marked.pop(STREAM_LOOKUP, None)
    with torch._inductor.config.patch(fx_graph_cache=True, unsafe_marked_cacheable_functions=marked), \
            aot_cache_bypasses() as reasons:
        torch.compile(step, fullgraph=True, dynamic=False)(torch.ones(4))
    assert len(reasons) == 1 and STREAM_LOOKUP.rsplit(".", 1)[1] in reasons[0], reasons


def test_cache_key_names_code_and_shapes(tmp_path):
    (tmp_path / "m.py").write_text("x = 1\n")
    parts = dict(backend="reduce-overhead", buckets=(1, 32), model="cfg")
    key = cache_key(parts, [tmp_path])
    assert key == cache_key(dict(parts), [tmp_path])
    assert key != cache_key(dict(parts, buckets=(1, 32, 128)), [tmp_path])
    (tmp_path / "m.py").write_text("x = 2\n")
    assert key != cache_key(parts, [tmp_path])


def test_compile_cache_setting(tiny, caplog):
    """auto: a cache where the back end compiles, none where it does not; a directory given where nothing
    compiles is named in a warning; null: none."""
    model = tiny[0]
    cpu = torch.device("cpu")
    compiled = EngineConfig(graphs=True, graph_backend="reduce-overhead")
    cache = engine_compile_cache(model, cpu, compiled, [1, 8])
    assert cache is not None and cache.directory == REPO / "outputs" / "compile_cache"
    assert cache.key != engine_compile_cache(model, cpu, compiled, [1, 8, 16]).key
    assert engine_compile_cache(model, cpu, EngineConfig(graphs=True, graph_backend="reduce-overhead",
                                                         compile_cache_dir=None), [1, 8]) is None
    with caplog.at_level(logging.WARNING):
        assert engine_compile_cache(model, cpu, EngineConfig(), [1, 8]) is None
        assert not caplog.records
        assert engine_compile_cache(model, cpu, EngineConfig(compile_cache_dir="/tmp/cc"), [1, 8]) is None
    assert "engine.compile_cache_dir=/tmp/cc is unused" in caplog.text
