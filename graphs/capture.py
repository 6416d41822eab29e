"""Captured steps, one per batch bucket: a step function run eagerly, compiled, or replayed from CUDA graphs.

`StepRunner` runs a step function (nemo_duplex/serving/runner.py builds it around `frame_step`) for a batch
of rows: it pads the batch to the next capture bucket with rows that point at the sink slot (so padding
touches no real call), replays that bucket's graph, and returns the real rows. Buckets are captured at
start-up, largest first, never while serving. A batch above the largest bucket is split into groups of at
most the largest bucket, each replayed. With `graphs=False` the very same function runs eagerly, so graphs
on and off compute the same thing (eager steps run the batch's own rows, or, with `pad_eager`, the same
padded rows and groups as the graphs). This package knows nothing of the model: the step function, the
tensors it writes in place (`static`), the sink row and the output fields to take to the host are given.

Batch invariance (`engine.batch_invariant`: one bucket, eager steps padded too): every step then runs the
same number of rows, so every kernel choice that follows the row count (on the GPU cuBLASLt's split-K,
cuDNN's convolution algorithm, the decode attention's split count) is the same whatever shares the step,
and a call's outputs are the same bit for bit alone or beside others.

Capture back ends (`engine.graph_backend`):
- "cudagraph" (default): `torch.compile` (Inductor's default mode) for fusion, each bucket's CUDA graph
  recorded by hand as below. With `engine.compile_dynamic_batch` ("auto": on here) one build with a dynamic
  batch dimension serves every bucket but 1, per variant.
- "cudagraph-eager" (the fallback: no compiler): the step as written, captured by hand with
  `torch.cuda.CUDAGraph` into static input buffers. Seconds to capture. The fusion Inductor would bring is
  done by hand instead: ops/ kernels for the norms, the attention, the Mamba step, the RNG and the codec GEMMs.
- "cudagraph-regions": the same hand capture, with the step's pure small-op pieces (the talker's MoG
  passes, the RNN-T symbol loop) compiled by Inductor on their own (graphs/regions.py says why it is off).
- "reduce-overhead": `torch.compile(fullgraph=True)` with mode="reduce-overhead"'s options (inductor_options);
  Inductor fuses the pointwise work and cudagraph trees record a CUDA graph per shape; the static tensors
  are marked as static inputs (mark_static_inputs: without the mark no graph is recorded) and written in
  place. Its inputs are the bucket's staged buffers, static too, so a step moves its inputs with one copy and
  its host fields with one copy each, and cudagraph trees copy nothing in; once capture() has built every
  bucket, a call checks only the guards that tell the builds apart (_run_prepared).
Why "cudagraph" and not "reduce-overhead" (docs/performance.md, "Compiled back ends"): on an H100,
reduce-overhead's step is 1.07x the hand capture's GPU time and 6.7-7.8x its host time per call (Dynamo's
frame and guards, cudagraph trees' check of the graph's 1,385 static input addresses, AOTAutograd's and
Inductor's wrappers: work a hand replay does not do). The same Inductor build recorded by hand is at parity:
N = 1 / 32 / 128 at position 600, 12.93 / 20.18 / 45.33 ms against the hand capture's 12.56 / 20.15 / 45.66;
a server of 128 places is ready 61 s after a restart (its compile cache), 206 s cold.
The Triton kernels are custom ops (opaque to torch.compile), so the compiled back ends keep fullgraph=True.
On a CPU there are no graphs: the compiled back ends still compile (Inductor's C++ back end, or
`compiler="aot_eager"`, which the CPU graphs-vs-eager test uses to trace the same graph cheaply).
One file past 500 lines on purpose: every back end records and replays through the same staged buffers,
padding and host copies, so they read side by side.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields

import numpy as np
import torch

from graphs.compile_cache import CompileCache, aot_cache_bypasses, compile_counters
from graphs.compiled import (
    cudagraph_skips,
    inductor_options,
    mark_static_inputs,
    tracing_free_tensors_as_attributes,
)
from graphs.fallbacks import register_inductor_fallbacks
from graphs.regions import install_regions
from graphs.shapes import record_graph

log = logging.getLogger(__name__)

NUMPY_DTYPES = {torch.int64: np.int64, torch.float32: np.float32}


BACKENDS = ("cudagraph-eager", "cudagraph-regions", "reduce-overhead", "cudagraph")
COMPILED = ("reduce-overhead", "cudagraph")   # the whole step built by torch.compile


def buckets_for(configured, max_calls: int) -> list[int]:
    """The capture buckets worth recording for at most max_calls rows: those below max_calls, then the
    smallest one at or above it (max_calls itself if none is). A bucket above that would never be used
    and costs a capture at start-up."""
    sizes = sorted(set(int(b) for b in configured))
    below = [b for b in sizes if b < max_calls]
    return below + [next((b for b in sizes if b >= max_calls), max_calls)]


def resolve_graphs(graphs, device: torch.device) -> bool:
    """engine.graphs: "auto" = captured on CUDA (the serving path), eager on the CPU (no graphs there)."""
    if graphs not in ("auto", True, False):
        raise ValueError(f"engine.graphs must be auto, true or false, got {graphs!r}")
    return device.type == "cuda" if graphs == "auto" else bool(graphs)


def step_compiles(graphs: bool, backend: str) -> bool:
    """Whether torch.compile builds any of the step (what a compile cache would keep): `graphs` resolved
    (resolve_graphs), `backend` an engine.graph_backend. Every back end but the hand capture of the eager
    step compiles something (cudagraph-regions its regions)."""
    return graphs and backend != "cudagraph-eager"


# ---------------------------------------------------------------------------------------------------------
# A step for the engine: numpy in, numpy out, as few torch calls as possible
# ---------------------------------------------------------------------------------------------------------
# Why: every torch call from Python releases the GIL and takes it back. The server's event loop holds it
# meanwhile, up to a switch interval each time, so under load each call costs the engine thread up to
# 0.5 ms. The general path (`runner(...)` then `to_host`) makes ~50 such calls per step: at 128 live calls
# the engine spent 12-15 ms per step before the device even started (docs/performance.md, "Load"). A
# captured bucket here takes four: one copy in, the replay, one copy out, one wait.

@dataclass
class HostStep:
    outputs: dict[str, np.ndarray]   # the host fields, first dim = the batch's rows, owned by the caller
    launched: float                  # perf_counter() once the step's device work was queued
    padded_rows: int                 # rows the device ran, capture-bucket padding included


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy tensors to the host with ONE wait for the device (pinned buffers, non-blocking copies)."""
    if not tensors or not tensors[0].is_cuda:
        return [t.cpu() for t in tensors]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]  # cached pinned blocks
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return host


class HostStepper:
    """What the engine calls a step through: `step_to_host`, numpy in and numpy out. This generic version
    calls the runner (`self(...)`) and copies `host_fields` out with one wait; StepRunner's captured buckets
    take a staged path of four torch calls instead. Test stand-ins and wrappers inherit it."""
    host_fields: tuple[str, ...] = ()
    takes_sampling_flag = True   # whether __call__ takes `sampling=`, `speech=`, `text=`

    def padded_rows(self, n: int) -> int:
        return n

    def step_to_host(self, slots: np.ndarray, audio: np.ndarray, forced: np.ndarray, sampling: bool = True,
                     speech: np.ndarray | None = None, text: np.ndarray | None = None, events=None) -> "HostStep":
        """One step for rows slots [n] int64, audio [n, frame] float32, forced [n] int64, speech and text slots
        [n] int64 (pipelined steps; None = slots); `sampling=False` when every row is greedy."""
        args = (torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)),
                torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32)),
                torch.from_numpy(np.ascontiguousarray(forced, dtype=np.int64)))
        if self.takes_sampling_flag:
            extra = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64))
                     for k, v in (("speech", speech), ("text", text)) if v is not None}
            out = self(*args, sampling=sampling, **extra)
        else:
            out = self(*args)
        launched = time.perf_counter()
        host = to_host([getattr(out, k) for k in self.host_fields])
        return HostStep({k: t.numpy() for k, t in zip(self.host_fields, host)}, launched, self.padded_rows(len(slots)))


class StepRunner(HostStepper):
    """`step(slots, audio, forced, speech, text, sampling)` -> a dataclass of [rows, ...] tensors, run per
    capture bucket. `static`: the tensors the step reads and writes besides its arguments (marked static
    for torch.compile); `sink`: the slot padding rows point at; `frame_samples`: audio per row;
    `host_fields`: the output fields `step_to_host` takes to the host; `regions_root`: the object whose
    pure pieces "cudagraph-regions" compiles (graphs/regions.py)."""

    def __init__(self, step, static: list[torch.Tensor], sink: int, frame_samples: int, device: torch.device,
                 buckets: list[int], graphs: bool | str = True, backend: str = "reduce-overhead",
                 compiler: str = "inductor", greedy_graphs: bool = False, pad_eager: bool = False,
                 host_fields: tuple[str, ...] = (), regions_root=None, label: str = "",
                 compile_cache: CompileCache | None = None, dynamic_batch: bool | str = False):
        self.step, self.sink, self.frame_samples = step, sink, frame_samples
        self.compile_cache = compile_cache   # the compiled back ends' work kept between runs (capture())
        self.label = label   # what the capture log says of the step (its pipeline depth, its SM carveout)
        self.host_fields = tuple(host_fields)
        self.pad_eager = pad_eager  # eager steps padded to the buckets as the graphs are (batch invariance)
        # greedy_graphs: every bucket also gets a variant for batches of greedy calls only (the step's
        # sampling=False: no sort over the vocabulary), at twice the captures; the general one serves all
        self.variants = (True, False) if greedy_graphs else (True,)
        self.buckets = sorted(set(int(b) for b in buckets))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"engine.capture_buckets must be positive sizes, got {buckets}")
        self.device = torch.device(device)
        self.graphs = resolve_graphs(graphs, self.device)
        if backend not in BACKENDS:
            raise ValueError(f"engine.graph_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.backend = backend
        if dynamic_batch not in ("auto", True, False):
            raise ValueError(f"engine.compile_dynamic_batch must be auto, true or false, got {dynamic_batch!r}")
        # "auto": one dynamic build wherever torch.compile builds the step (the default back end does)
        self.dynamic_batch = bool(dynamic_batch) and self.graphs and backend in COMPILED   # _bucket_inputs
        if dynamic_batch is True and not self.dynamic_batch:
            log.warning("engine.compile_dynamic_batch=true is unused: engine.graph_backend=%s (engine.graphs=%s) "
                        "builds nothing with torch.compile", backend, graphs)
        if self.dynamic_batch and self.buckets[0] == 1 and len(self.buckets) > 1:
            # measured on an H100: ~50 s of a 130 s restart from the compile cache (docs/performance.md)
            log.info("engine.compile_dynamic_batch: bucket 1 is a build of its own (Dynamo specialises a size of 1), "
                     "at every start; without 1 in engine.capture_buckets a call alone runs in bucket %d",
                     self.buckets[1])
        self._compiled = None   # the step as capture() runs it: eager, or torch.compile's (traced with settings)
        self._built = None      # torch.compile's step itself (compiled back ends)
        self._cuda_graphs: dict[tuple, tuple] = {}  # (bucket, sampling) -> graph, its outputs (inputs: _inputs)
        self._graph_pool = None  # shared by every bucket's graph (_capture_cuda_graph)
        self._capture_stream = None  # the buckets' own (a cuBLAS workspace per stream: graphs/shapes.py)
        # per captured or compiled (bucket, sampling): pinned host twins of in/outputs (_staged)
        self._staging: dict[tuple, tuple] = {}
        self._inputs: dict[int, tuple] = {}     # per bucket: static inputs, shared by its variants
        self.capture_seconds: dict[int, float] = {}
        # per captured (bucket, sampling): its first and second replay at capture (_capture_cuda_graph), ms
        self.replay_ms: dict[tuple, tuple[float, float]] = {}
        self.regions = []
        if self.graphs and backend == "cudagraph-eager":
            self._compiled = self._eager
        elif self.graphs and backend == "cudagraph-regions":
            self.regions = install_regions(regions_root, compiler)  # compiled on the capture's warm-up calls
            self._compiled = self._eager
        elif self.graphs:
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                        4 * len(self.buckets) * len(self.variants))
            mark_static_inputs(static)
            register_inductor_fallbacks()
            # compiler "aot_eager" traces the same graph but runs it with eager kernels: the CPU test of
            # graphs-vs-eager uses it, since Inductor's C++ build of the whole step takes minutes there
            options = inductor_options(backend, self.device) if compiler == "inductor" else None
            self._built = torch.compile(self._eager, options=options, backend=compiler, fullgraph=True,
                                        dynamic=None if self.dynamic_batch else False)
            self._compiled = tracing_free_tensors_as_attributes(self._built)

    @property
    def staged(self) -> bool:
        """Captured or compiled buckets step through the staged path (step_to_host)."""
        return bool(self._staging)

    @property
    def kind(self) -> str:
        """What the steps run as: the capture back end, or "eager" where there are no graphs (graphs "auto"
        resolved)."""
        return self.backend if self.graphs else "eager"

    @property
    def compiles(self) -> bool:
        """Whether anything of the step is built by torch.compile (what a compile cache would keep)."""
        return step_compiles(self.graphs, self.backend)

    @property
    def hand_run(self) -> bool:
        """Eager steps, or captured by hand: what may switch CUDA streams and process-wide settings inside a
        step (torch.compile's whole-step graphs would have to trace those)."""
        return not self.graphs or self.backend.startswith("cudagraph")

    def _eager(self, slots: torch.Tensor, audio: torch.Tensor, forced: torch.Tensor,
               speech: torch.Tensor | None = None, text: torch.Tensor | None = None, sampling: bool = True):
        return self.step(slots, audio, forced, slots if speech is None else speech, slots if text is None else text,
                         sampling)

    def padded_rows(self, n: int) -> int:
        """Rows a batch of n runs as: its bucket (groups of the largest bucket above it); n when eager
        (unless `pad_eager`)."""
        if not self.graphs and not self.pad_eager:
            return n
        largest = self.buckets[-1]
        full, rest = divmod(n, largest)
        return full * largest + (self.bucket_for(rest) if rest else 0)

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _padded_inputs(self, b: int, slots, audio, forced, speech=None, text=None):
        """The rows padded to b: slots, audio, forced, speech slots, text slots (None: the slots)."""
        n = slots.shape[0]
        s, a, f, ss, ts = (torch.full((b,), self.sink, dtype=torch.int64, device=self.device),
                           torch.zeros(b, audio.shape[1], dtype=torch.float32, device=self.device),
                           torch.full((b,), -1, dtype=torch.int64, device=self.device),
                           torch.full((b,), self.sink, dtype=torch.int64, device=self.device),
                           torch.full((b,), self.sink, dtype=torch.int64, device=self.device))
        for buf, rows in ((s, slots), (a, audio), (f, forced), (ss, slots if speech is None else speech),
                          (ts, slots if text is None else text)):
            buf[:n] = rows.to(self.device, non_blocking=True)
        return s, a, f, ss, ts

    @torch.no_grad()
    def capture(self) -> None:
        """Record every bucket, largest first, on padding rows only (the sink slot)."""
        if not self.graphs:
            return
        cache = self.compile_cache
        if cache is not None:
            cache.activate()
        if self.backend in COMPILED and (cache is None or not cache.loaded):
            # the first start's wait is the compiler's; say so, and what the fallback would cost
            log.info("engine.graph_backend=%s: torch.compile builds the step (minutes; docs/performance.md, "
                     "\"Compiled back ends\", has them measured); %s engine.graph_backend=cudagraph-eager captures "
                     "it by hand in under a minute",
                     self.backend, "no compile cache (engine.compile_cache_dir=null), so every start builds it;"
                     if cache is None else f"a restart loads it from {cache.directory};")
        if cache is None:
            self._record_or_name_the_fallback()
            return
        before = compile_counters()
        with aot_cache_bypasses() as bypasses:
            self._record_or_name_the_fallback()
        cache.save()
        counts = {k: v - before[k] for k, v in compile_counters().items()}
        log.info("compile cache %s: %d graphs from the cache, %d compiled; AOTAutograd's cache: %d hits, %d misses, "
                 "%d bypassed", cache.directory, counts["fxgraph_cache_hit"], counts["fxgraph_cache_miss"],
                 counts["autograd_cache_hit"], counts["autograd_cache_miss"], counts["autograd_cache_bypass"])
        for reason in dict.fromkeys(bypasses):   # each once: every build of the step gives the same
            log.warning("AOTAutograd's cache keeps none of this build, so each start traces it again: %s", reason[:500])

    def _record_or_name_the_fallback(self) -> None:
        """_record_buckets, where a compiler's failure (Dynamo's or Inductor's: a torch or Triton this code was
        not built against, no C compiler) ends the start with the setting that serves without the compiler."""
        try:
            self._record_buckets()
        except torch._dynamo.exc.TorchDynamoException as e:
            if self.backend not in COMPILED:
                raise
            raise RuntimeError(f"engine.graph_backend={self.backend}: torch.compile could not build the step "
                               f"({type(e).__name__}: {str(e)[:400]}); engine.graph_backend=cudagraph-eager "
                               "captures the step as written, without the compiler") from e

    def _record_buckets(self) -> None:
        n_in = self.frame_samples
        skips = cudagraph_skips()
        for b in sorted(self.buckets, reverse=True):
            t0 = time.perf_counter()
            for sampling in self.variants:
                if self.backend.startswith("cudagraph") and self.device.type == "cuda":
                    self._capture_cuda_graph(b, sampling)
                elif self.backend in COMPILED:
                    self._prepare_compiled(b, sampling)
                else:   # the hand capture's step on a machine without CUDA graphs: run as it is
                    none = torch.empty(0, dtype=torch.int64)
                    inputs = self._padded_inputs(b, none, torch.empty(0, n_in), none)
                    for _ in range(3):
                        self._compiled(*inputs, sampling)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.capture_seconds[b] = time.perf_counter() - t0
            replays = ", ".join("%.1f / %.1f" % self.replay_ms[(b, v)] for v in self.variants if (b, v) in self.replay_ms)
            log.info("captured bucket %d (%s%s) in %.1f s; first / second replay %s ms",
                     b, self.backend, f", {self.label}" if self.label else "", self.capture_seconds[b], replays or "-")
            if self.backend == "reduce-overhead" and self.device.type == "cuda" and cudagraph_skips() > skips:
                raise RuntimeError(f"engine.graph_backend=reduce-overhead recorded no CUDA graph for bucket {b} "
                                   "(torch.compile skipped it; TORCH_LOGS=cudagraphs says why)")

    def _staged_inputs(self, b: int):
        """A bucket's static inputs as views of ONE device buffer, with a pinned host twin: a step then
        moves its inputs with one copy (step_to_host). Audio first, so every view stays aligned."""
        n_in = self.frame_samples
        nbytes = b * n_in * 4 + 4 * b * 8
        device_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

        def split(buf):
            a = buf[: b * n_in * 4].view(torch.float32).view(b, n_in)
            s, f, ss, ts = buf[b * n_in * 4:].view(torch.int64).view(4, b)
            return s, a, f, ss, ts
        s, a, f, ss, ts = split(device_buf)
        for t in (s, ss, ts):
            t.fill_(self.sink)
        a.zero_()
        f.fill_(-1)
        host = tuple(t.numpy() for t in split(host_buf))
        return (s, a, f, ss, ts), (device_buf, host_buf, host)

    def _host_outputs(self, out, packed: bool):
        """One host buffer (pinned on CUDA) for the step's host fields in `host_fields` order, with each
        field's numpy view into it: packed back to back as the hand capture's graph writes them (one copy
        out), or each field 8-byte aligned with a torch view to copy it into (`packed=False`)."""
        offsets, total = {}, 0
        for k in self.host_fields:
            t = getattr(out, k)
            total = total if packed else -(-total // 8) * 8
            offsets[k] = (total, t)
            total += t.numel() * t.element_size()
        host_out = torch.empty(total, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        flat, views, tensors = host_out.numpy(), {}, {}
        for k, (offset, t) in offsets.items():
            end = offset + t.numel() * t.element_size()
            views[k] = flat[offset: end].view(NUMPY_DTYPES[t.dtype]).reshape(t.shape)
            if not packed:
                tensors[k] = host_out[offset: end].view(t.dtype).view(t.shape)
        return host_out, views, None if packed else tensors

    def _prepare_compiled(self, b: int, sampling: bool) -> None:
        """torch.compile's build of bucket b, called on the bucket's staged inputs (_staged_inputs, as the hand
        capture's): marked static, so cudagraph trees copy nothing in and a step moves its inputs with one
        copy; its host fields go out through one host buffer, one copy each (step_to_host). Its calls from
        then on check only the guards between builds (_run_prepared): the first such call is made here, so a
        build that cannot serve that way fails at start-up, and its outputs give the host buffer's layout."""
        static, staging = self._bucket_inputs(b)
        for _ in range(3):  # compile, then (reduce-overhead) warm up and record the graph
            self._compiled(*static, sampling)   # no output kept alive into the next call (cudagraph trees)
        host_out, views, tensors = self._host_outputs(self._run_prepared(*static, sampling), packed=False)
        self._staging[(b, sampling)] = staging + (None, host_out, views, tensors)

    def _bucket_inputs(self, b: int):
        """Bucket b's staged inputs (_staged_inputs), made once and shared by its variants. For a torch.compile
        build: marked static (mark_static_inputs), and with engine.compile_dynamic_batch their batch
        dimension marked dynamic, so that the first build (the largest bucket's) already serves the others:
        built static first, the second bucket would make a dynamic build that Dynamo may then pick for the
        first bucket too at a call that skips the guards between builds, and record a CUDA graph then."""
        if b not in self._inputs:
            self._inputs[b] = self._staged_inputs(b)
            if self._built is not None:
                mark_static_inputs(list(self._inputs[b][0]))
                for t in self._inputs[b][0] if self.dynamic_batch else ():
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        return self._inputs[b]

    def _capture_cuda_graph(self, b: int, sampling: bool = True) -> None:
        static, staging = self._bucket_inputs(b)

        def step_and_pack():
            out = self._compiled(*static, sampling)
            # the fields the engine takes to the host, packed into one buffer inside the graph: one copy out
            return out, torch.cat([getattr(out, k).reshape(b, -1).contiguous().view(torch.uint8).reshape(-1)
                                   for k in self.host_fields])
        # One memory pool for every bucket: the graphs replay one at a time on one stream and each
        # replay's outputs are copied out before the next (__call__), so a bucket may reuse the memory of
        # another's intermediates. Private pools would cost one step's activations per bucket.
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream()
        graph, (out, packed) = record_graph(step_and_pack, 3, self._graph_pool, self._capture_stream)
        if self._graph_pool is None:
            self._graph_pool = graph.pool()
        host_out, views, _ = self._host_outputs(out, packed=True)
        self._cuda_graphs[(b, sampling)] = (graph, out)
        self._staging[(b, sampling)] = staging + (packed, host_out, views, None)
        # Replay once now, on the sink rows the static inputs still hold, so that whatever a graph's first
        # launch costs (its upload to the device) is paid at start-up, not by the first calls in a bucket.
        # Measured: the first replay here takes 0.3-1.3 ms more than the second; a load run without this
        # warm replay once had a 221 ms first step at 128 lockstep calls (first audio p50 498 ms against 67 ms
        # with it, one run each; docs/performance.md).
        times = []
        for _ in range(2):  # the second replay, for comparison in the log
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        self.replay_ms[(b, sampling)] = (times[0], times[1])

    @torch.no_grad()   # as built in capture(): grad mode is one of the guards no longer evaluated
    def _run_prepared(self, *inputs):
        """A torch.compile'd step for a (bucket, variant) that capture() compiled, with Dynamo evaluating only
        the guards that tell its builds apart (the inputs' shapes, `sampling`).

        Why: before each call Dynamo checks every guard of the build, on the step's weights and pools: with
        the tiny widths at the full layer counts, on this project's CPU, 667 us a call against 185 with only
        the guards between builds (scripts/dev/compiled_host_cost.py; docs/performance.md). The other guards
        cannot fail here: the weights and pools are the same tensors for the runner's life (allocated once,
        written in place), nothing the step reads from Python changes after start-up, and the runner only
        ever calls the step with inputs padded to a bucket that capture() compiled. A call outside that set
        takes the guarded path, as does one that Dynamo refuses for torch settings changed since."""
        try:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self._built(*inputs)   # built: no tracing, so no tracing settings to set
        except RuntimeError as e:
            # Dynamo still checks torch's global settings (deterministic algorithms, ...) and refuses, before
            # running anything, a call made under others than the builds': such a call takes every guard
            # and builds what it needs, slower once, and serving goes on
            if "skip_guard_eval_unsafe" not in str(e):
                raise
            log.warning("a compiled step was called under torch settings its builds were not made under "
                        "(changed since capture()); this call evaluates every guard and may compile")
            return self._compiled(*inputs)

    def variant(self, b: int, sampling: bool) -> tuple[int, bool]:
        """The captured graph for a batch in bucket b: the greedy-only one when the batch is all greedy
        and it was captured, else the general one (exact for greedy rows too)."""
        return (b, False) if not sampling and (b, False) in self._staging else (b, True)

    @torch.no_grad()
    def __call__(self, slots: torch.Tensor, audio: torch.Tensor, forced: torch.Tensor,
                 sampling: bool = True, speech: torch.Tensor | None = None,
                 text: torch.Tensor | None = None):
        """`sampling=False`: the caller vouches that every row is greedy (frame_step). `speech`, `text`: the
        rows' slots on those halves when pipelined (None: the rows' own slots)."""
        n = slots.shape[0]
        speech = slots if speech is None else speech
        text = slots if text is None else text
        if not self.graphs and not self.pad_eager:
            return self.step(slots.to(self.device), audio.to(self.device), forced.to(self.device),
                             speech.to(self.device), text.to(self.device), sampling)
        sampling = sampling or False not in self.variants  # only what capture() prepared, never a new compile
        largest = self.buckets[-1]
        if n > largest:  # groups of at most the largest bucket, each replayed
            parts = [self(slots[i: i + largest], audio[i: i + largest], forced[i: i + largest], sampling,
                          speech[i: i + largest], text[i: i + largest]) for i in range(0, n, largest)]
            return type(parts[0])(**{fl.name: torch.cat([getattr(p, fl.name) for p in parts]) for fl in fields(parts[0])})
        b = self.bucket_for(n)
        key = self.variant(b, sampling)
        if key in self._staging:   # captured by hand or built by torch.compile: the bucket's staged inputs
            static = self._inputs[b][0]
            for buf, new in zip(static, self._padded_inputs(b, slots, audio, forced, speech, text)):
                buf.copy_(new)
            if key in self._cuda_graphs:
                graph, out = self._cuda_graphs[key]
                graph.replay()
            else:
                out = self._run_prepared(*static, key[1])
        else:
            out = (self._compiled or self._eager)(*self._padded_inputs(b, slots, audio, forced, speech, text),
                                                  sampling)
        # a replayed graph reuses its output memory on the next replay: copy the real rows out now
        return type(out)(**{fl.name: getattr(out, fl.name)[:n].clone() for fl in fields(out)})

    def step_to_host(self, slots, audio, forced, sampling=True, speech=None, text=None,
                             events=None) -> HostStep:
        """StepRunner.step_to_host: a captured or compiled bucket takes the staged path (its inputs through one
        pinned buffer, the replay or the compiled step, its outputs through another; a batch above the largest
        bucket in groups, each staged); anything else (eager) runs as HostStepper does. `events` (two CUDA timing events, staged
        path only): recorded just before the step's input copy and just after its output copy are queued
        (scripts/bench_step.py)."""
        n = len(slots)
        largest = self.buckets[-1]
        if self._staging:
            key = self.variant(self.bucket_for(n), sampling) if n <= largest else None
            if key in self._staging:
                return self._staged(key, slots, audio, forced, slots if speech is None else speech,
                                    slots if text is None else text, events)
            if n > largest:  # groups of at most the largest bucket, each its own staged step
                part = lambda rows, i: None if rows is None else rows[i: i + largest]  # noqa: E731
                parts = [self.step_to_host(slots[i: i + largest], audio[i: i + largest], forced[i: i + largest],
                                           sampling, part(speech, i), part(text, i))
                         for i in range(0, n, largest)]
                return HostStep({k: np.concatenate([p.outputs[k] for p in parts]) for k in self.host_fields},
                                parts[-1].launched, sum(p.padded_rows for p in parts))
        return HostStepper.step_to_host(self, slots, audio, forced, sampling, speech, text)


    def _staged(self, key: tuple[int, bool], slots, audio, forced, speech, text, events=None) -> HostStep:
        device_in, host_in, (s, a, f, ss, ts), packed, host_out, views, field_out = self._staging[key]
        b = key[0]
        n = len(slots)
        s[:n], s[n:] = slots, self.sink   # padding rows: the sink on every half, silence, nothing forced
        a[:n], a[n:] = audio, 0.0
        f[:n], f[n:] = forced, -1
        ss[:n], ss[n:] = speech, self.sink
        ts[:n], ts[n:] = text, self.sink
        if events is not None:
            events[0].record()
        device_in.copy_(host_in, non_blocking=True)
        if packed is not None:   # captured by hand: the graph packed the host fields
            self._cuda_graphs[key][0].replay()
            host_out.copy_(packed, non_blocking=True)
        else:                    # torch.compile's build
            out = self._run_prepared(*self._inputs[b][0], key[1])
            for k, t in field_out.items():
                t.copy_(getattr(out, k), non_blocking=True)
        if events is not None:
            events[1].record()
        launched = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        # copies: the pinned buffers are overwritten by the bucket's next step
        return HostStep({k: views[k][:n].copy() for k in self.host_fields}, launched, b)
