"""Recording a CUDA graph (`record_graph`, which every capture here goes through) and a function captured
as one CUDA graph per input shape (`ShapeGraphs`).

For work that is not a batch step but runs often enough that its host time matters, and whose inputs
come in a few known shapes: a new call's admission (serving/admission_graphs.py) runs ~1,500 small
kernels per piece of its prompt, 0.35-0.46 s for 500 tokens on the H200 when launched one by one from
Python, host time that holds the GIL the engine thread and the server's event loop need. Replayed, it is
a few launches. Like StepRunner, this knows nothing of the model: the function, its inputs and the keys
are given. The function writes what it computes in place (its outputs are not kept); its inputs are
copied into static buffers before each replay.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable

import torch


def record_graph(fn: Callable[[], object], warmups: int, pool, stream: torch.cuda.Stream):
    """(graph, fn's result): fn run `warmups` times on a side stream (cuBLAS workspaces, lazy inits, autotuning:
    work that must not happen inside a capture), then recorded on `stream` into memory pool `pool` (None: a new
    one). `stream` is the recording owner's own (ShapeGraphs' docstring says why); the result's tensors live in
    the pool, rewritten by every replay."""
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        result = fn()
    return graph, result


class ShapeGraphs:
    """fn(*inputs), recorded per key (`capture`) and replayed (`__call__`); a key never captured, or
    `graphs=False`, runs fn eagerly on the inputs as given. The graphs share one memory pool of their own:
    they replay one at a time (one caller thread) and keep no outputs, and the pool is not the step
    graphs', which may replay at the same time on another stream.

    They are also recorded on a capture stream of their own, for the same reason: torch gives cuBLAS and
    cuBLASLt a workspace per (thread's handle, current stream), and a graph keeps the address of the one
    it was recorded with. Recorded on one stream (torch.cuda.graph's default capture stream serves every
    capture that names none), an admission's GEMMs and a concurrent step's would share one workspace:
    cuBLASLt's split-K kernels keep partial sums and arrival counters there, so two at once can corrupt
    each other's sums or wait forever (on the H200, a load run with captured admissions arriving beside
    128 live calls never finished)."""

    def __init__(self, fn: Callable[..., None], device: torch.device, graphs: bool):
        if graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.fn, self.device, self.graphs = fn, device, graphs
        self._captured: dict[Hashable, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self._pool = None
        self.capture_stream = torch.cuda.Stream(device) if graphs else None

    @property
    def keys(self) -> list[Hashable]:
        return list(self._captured)

    @torch.no_grad()
    def capture(self, key: Hashable, *inputs: torch.Tensor) -> None:
        """Record fn for `key` on copies of `inputs` (their shapes, dtypes and values: the warm-up runs and
        the recording compute on them for real, so they must be harmless to write, e.g. the sink slot)."""
        if not self.graphs:
            return
        static = tuple(t.to(self.device).clone() for t in inputs)
        with torch.cuda.device(self.device):
            graph, _ = record_graph(lambda: self.fn(*static), 2, self._pool, self.capture_stream)
        if self._pool is None:
            self._pool = graph.pool()
        graph.replay()   # its first launch (the upload) now, not in the first call's admission
        torch.cuda.synchronize(self.device)
        self._captured[key] = (graph, static)

    def __call__(self, key: Hashable, *inputs: torch.Tensor) -> None:
        """fn(*inputs) on the current stream: copies of the inputs and the replay of `key`'s graph, or fn
        itself where `key` was not captured."""
        entry = self._captured.get(key)
        if entry is None:
            self.fn(*inputs)
            return
        graph, static = entry
        for buf, x in zip(static, inputs, strict=True):
            if buf.shape != x.shape:
                raise ValueError(f"graph {key!r} was captured for inputs of shape {tuple(buf.shape)}, "
                                 f"got {tuple(x.shape)}")
            buf.copy_(x, non_blocking=True)
        graph.replay()
