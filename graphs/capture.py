"""Captured frame steps, one per batch bucket.

`StepRunner` runs `frame_step` for a batch of calls: it pads the batch to the next capture bucket with
rows that point at the sink slot (so padding touches no real call), replays that bucket's graph, and
returns the real rows. Buckets are captured at start-up, largest first, never while serving. A batch
above the largest bucket is split into groups of at most the largest bucket, each replayed. With
`graphs=False` the very same function runs eagerly, so graphs on and off compute the same thing.

Three capture back ends (`engine.graph_backend`):
- "cudagraph-eager" (default): the step as written, captured by hand with `torch.cuda.CUDAGraph` into
  static input buffers. Seconds to capture. The fusion Inductor would bring is done by hand instead:
  ops/ kernels for the norms (with the talker's rotary), the attention, the Mamba step, the RNG and the
  codec GEMMs, which took the step from ~7,300 to ~3,600 kernels (docs/performance.md).
- "cudagraph-regions": the same hand capture, with the step's pure small-op pieces (the talker's MoG
  passes, the RNN-T symbol loop) compiled by Inductor on their own (graphs/regions.py). Not measured on
  a GPU yet.
- "reduce-overhead": `torch.compile(mode="reduce-overhead", fullgraph=True)`; Inductor fuses the
  pointwise work and records a CUDA graph per shape; the pools are closed over and mutated in place.
- "cudagraph": `torch.compile` (default mode) for fusion, captured by hand as above: for when
  reduce-overhead declines to record a graph (cudagraph trees skip functions that mutate tensors they do
  not treat as static inputs, which a state pool may be).
Why the hand capture serves: at full size on the H200 (torch 2.11), compiling the whole step for ONE
bucket ran 4 minutes and then failed in Inductor's code generation for the text sampler's cumsum over
131,072 logits (a split scan; docs/runs/compile_2026-11-29_s2_2_inductor_bucket32.log). Eight buckets
would take over half an hour to build even once that is worked around. The Triton kernels are custom
ops (opaque to torch.compile), so the compiled back ends keep fullgraph=True; they compile and match
eager on the CPU (tests/test_graphs.py, `compiler="aot_eager"`).
On a CPU there are no graphs: the compiled back ends still compile (Inductor's C++ back end, or
`compiler="aot_eager"`, which the CPU graphs-vs-eager test uses to trace the same graph cheaply).
"""
from __future__ import annotations

import logging
import time
from dataclasses import fields

import torch

from graphs.regions import install_regions
from nemo_duplex.frame_step import StepOutput, frame_step

log = logging.getLogger(__name__)


BACKENDS = ("cudagraph-eager", "cudagraph-regions", "reduce-overhead", "cudagraph")


class StepRunner:
    def __init__(self, model, state, specials: torch.Tensor, buckets: list[int], graphs: bool | str = True,
                 backend: str = "reduce-overhead", compiler: str = "inductor"):
        self.model, self.state, self.specials = model, state, specials
        self.buckets = sorted(set(int(b) for b in buckets))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"engine.capture_buckets must be positive sizes, got {buckets}")
        self.device = state.llm_len.device
        # "auto": captured on CUDA (the serving path), eager on the CPU (no graphs there)
        self.graphs = self.device.type == "cuda" if graphs == "auto" else bool(graphs)
        self.backend = backend
        self.sink = state.sink
        self._compiled = None
        self._cuda_graphs: dict[int, tuple] = {}
        self.capture_seconds: dict[int, float] = {}
        self.regions = []
        if backend not in BACKENDS:
            raise ValueError(f"engine.graph_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if self.graphs and backend == "cudagraph-eager":
            self._compiled = self._eager
        elif self.graphs and backend == "cudagraph-regions":
            self.regions = install_regions(model, compiler)  # compiled on the capture's warm-up calls
            self._compiled = self._eager
        elif self.graphs:
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(self.buckets))
            mode = "reduce-overhead" if backend == "reduce-overhead" and self.device.type == "cuda" else None
            # compiler "aot_eager" traces the same graph but runs it with eager kernels: the CPU test of
            # graphs-vs-eager uses it, since Inductor's C++ build of the whole step takes minutes there
            self._compiled = torch.compile(self._eager, mode=mode if compiler == "inductor" else None,
                                           backend=compiler, fullgraph=True, dynamic=False)

    def _eager(self, slots: torch.Tensor, audio: torch.Tensor, forced: torch.Tensor) -> StepOutput:
        return frame_step(self.model, self.state, slots, audio, forced, self.specials)

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _padded_inputs(self, b: int, slots, audio, forced):
        n = slots.shape[0]
        s = torch.full((b,), self.sink, dtype=torch.int64, device=self.device)
        a = torch.zeros(b, audio.shape[1], dtype=torch.float32, device=self.device)
        f = torch.full((b,), -1, dtype=torch.int64, device=self.device)
        s[:n] = slots.to(self.device, non_blocking=True)
        a[:n] = audio.to(self.device, non_blocking=True)
        f[:n] = forced.to(self.device, non_blocking=True)
        return s, a, f

    @torch.no_grad()
    def capture(self) -> None:
        """Record every bucket, largest first, on padding rows only (the sink slot)."""
        if not self.graphs:
            return
        n_in = self.model.cfg.samples_per_frame_in
        for b in sorted(self.buckets, reverse=True):
            t0 = time.perf_counter()
            s, a, f = self._padded_inputs(b, torch.empty(0, dtype=torch.int64), torch.empty(0, n_in),
                                          torch.empty(0, dtype=torch.int64))
            if self.backend.startswith("cudagraph") and self.device.type == "cuda":
                self._capture_cuda_graph(b, s, a, f)
            else:
                for _ in range(3):  # compile, then (reduce-overhead) warm up and record the graph
                    self._compiled(s, a, f)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.capture_seconds[b] = time.perf_counter() - t0
            log.info("captured bucket %d (%s) in %.1f s", b, self.backend, self.capture_seconds[b])

    def _capture_cuda_graph(self, b: int, s, a, f) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._compiled(s, a, f)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._compiled(s, a, f)
        self._cuda_graphs[b] = (graph, s, a, f, out)

    @torch.no_grad()
    def __call__(self, slots: torch.Tensor, audio: torch.Tensor, forced: torch.Tensor) -> StepOutput:
        n = slots.shape[0]
        if not self.graphs:
            return frame_step(self.model, self.state, slots.to(self.device), audio.to(self.device),
                              forced.to(self.device), self.specials)
        largest = self.buckets[-1]
        if n > largest:  # groups of at most the largest bucket, each replayed
            parts = [self(slots[i: i + largest], audio[i: i + largest], forced[i: i + largest])
                     for i in range(0, n, largest)]
            return StepOutput(**{fl.name: torch.cat([getattr(p, fl.name) for p in parts]) for fl in fields(StepOutput)})
        b = self.bucket_for(n)
        if b in self._cuda_graphs:
            graph, s, a, f, out = self._cuda_graphs[b]
            ns, na, nf = self._padded_inputs(b, slots, audio, forced)
            s.copy_(ns)
            a.copy_(na)
            f.copy_(nf)
            graph.replay()
        else:
            out = self._compiled(*self._padded_inputs(b, slots, audio, forced))
        # a replayed graph reuses its output memory on the next replay: copy the real rows out now
        return StepOutput(**{fl.name: getattr(out, fl.name)[:n].clone() for fl in fields(StepOutput)})
