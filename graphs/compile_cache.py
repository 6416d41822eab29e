"""A persistent cache of torch.compile's work for the compiled back ends (engine.compile_cache_dir).

Why: building one bucket of the step under `reduce-overhead` took 71-86 s on the H200, most of it
Inductor's code generation and Triton's kernel builds (docs/performance.md, "Compiled back ends"); twenty
buckets are half an hour before a server is ready. Both results can be kept: Inductor's FX graph cache
and AOTAutograd's cache (keyed by the traced graph, its input shapes, the configuration and the torch
version) and Triton's kernel cache live under a directory, and `torch.compiler.save_cache_artifacts`
packs what a run compiled into one file that a later process, on this machine or a fresh one, loads
before it compiles (`load_cache_artifacts`), so its compiles hit those caches instead of building.

`CompileCache(directory, key)`: the directory holds `inductor/` and `triton/` (set for the whole process
by `activate`, before the first compile) and `artifacts-<key>.bin`. The key names the code and shapes the
artifacts were made for (`cache_key`); artifacts under another key are never loaded, and a stale entry
under the right key can only miss (the caches check their own keys), never give a wrong kernel.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path
from typing import Iterator

import torch

log = logging.getLogger(__name__)


def source_digest(roots: list[Path]) -> str:
    """sha256 of every .py file's path and contents under `roots`: the code whose compile is cached."""
    h = hashlib.sha256()
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def cache_key(parts: dict, roots: list[Path]) -> str:
    """16 hex digits naming the code (`roots`' sources, torch's and Triton's versions) and what is compiled
    (`parts`: the back end, the buckets, the model's dimensions and dtypes, the device)."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    named = dict(parts, torch=torch.__version__, triton=triton_version, source=source_digest(roots))
    return hashlib.sha256(repr(sorted(named.items())).encode()).hexdigest()[:16]


def compile_counters() -> dict[str, int]:
    """Inductor's FX graph cache hits and misses, and AOTAutograd's cache hits, misses and bypasses, so far
    in this process."""
    from torch._dynamo.utils import counters
    return dict({k: int(counters["inductor"][k]) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")},
                **{k: int(counters["aot_autograd"][k])
                   for k in ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")})


AOT_CACHE_LOGGER = "torch._functorch._aot_autograd.autograd_cache"

# How a Dynamo graph reaches a CUDA stream or event it uses (the hand-run step's side streams, which the
# `cudagraph` back end traces): a call of this function with the index Dynamo gave the object when it traced
# the step. AOTAutograd's cache refuses any graph that calls a function it does not know, so it kept none of
# the step's builds: each start traced them again, 11-21 s a build on the H100 (docs/performance.md,
# "Compiled back ends"). Marking it cacheable is sound: it reads no state of its own beyond Dynamo's table,
# which Dynamo fills anew at every call of the traced frame (no cache keeps Dynamo's work); the index is a
# constant of the graph, and the graph is the cache's key, so a hit returns what compiling that same graph
# gives, with the same index looked up in the same table at run time. Keyed by torch's version, which owns
# the table.
STREAM_LOOKUP = "torch._dynamo.graph_bytecode_inputs.get_external_object_by_index"


@contextlib.contextmanager
def aot_cache_bypasses() -> Iterator[list[str]]:
    """The reasons AOTAutograd's cache gives, while in the block, for not caching a graph (a list filled as
    they come).

    Why: a bypassed graph is traced by AOTAutograd again at every start even when Inductor's cache then has
    its code: on the H100 11-21 s of the 22-35 s each of the `cudagraph` back end's builds took when
    restored from the cache (docs/performance.md, "Compiled back ends"). torch says why only in an INFO
    record of that logger, which its own logging setting hides; here the records are taken from the logger
    itself for the block, and not passed on to torch's handlers."""
    reasons: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith(("Bypassing autograd cache", "AOTAutograd cache unable to serialize")):
                reasons.append(message)

    logger = logging.getLogger(AOT_CACHE_LOGGER)
    handler, level, propagate = Keep(), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield reasons
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


class CompileCache:
    def __init__(self, directory: str | Path, key: str):
        self.directory = Path(directory)
        self.key = key
        self.artifacts = self.directory / f"artifacts-{key}.bin"
        self.loaded = False

    def activate(self) -> None:
        """Point Inductor's and Triton's caches at the directory (process-wide: their environment variables,
        read at each compile) and load the artifacts saved under this key, if any. Call before compiling."""
        import torch._functorch.config
        import torch._inductor.config

        (self.directory / "inductor").mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.directory / "inductor")
        os.environ["TRITON_CACHE_DIR"] = str(self.directory / "triton")
        torch._inductor.config.fx_graph_cache = True
        torch._functorch.config.enable_autograd_cache = True
        torch._inductor.config.unsafe_marked_cacheable_functions = dict(
            torch._inductor.config.unsafe_marked_cacheable_functions, **{STREAM_LOOKUP: torch.__version__})
        if self.artifacts.exists():
            torch.compiler.load_cache_artifacts(self.artifacts.read_bytes())
            self.loaded = True
            log.info("compile cache: loaded %s", self.artifacts)

    def save(self) -> None:
        """Write what this process compiled (with what it loaded) to the artifacts file, atomically."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        data, _ = saved
        tmp = self.artifacts.with_suffix(f".{os.getpid()}.tmp")   # replicas of one machine may save at once
        tmp.write_bytes(data)
        tmp.replace(self.artifacts)
        log.info("compile cache: saved %s (%.1f MiB)", self.artifacts, len(data) / 2**20)
