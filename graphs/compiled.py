"""What a whole-step torch.compile build (engine.graph_backend reduce-overhead or cudagraph) is given
besides the step: which inputs are static, Inductor's settings, how Dynamo traces the weights, and
Inductor's count of steps it ran without a CUDA graph. graphs/capture.py's StepRunner builds with them;
docs/performance.md ("Compiled back ends") has the measurements behind each.
"""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)


def mark_static_inputs(static: list[torch.Tensor]) -> None:
    """Mark tensors as static addresses for torch.compile: every tensor the step reads or writes outside its
    arguments (the state pools, the special-token ids), and a bucket's staged rows (its arguments, written
    in place before each call).

    Why: the step reaches the pools through its closure, so Dynamo lifts each one into a graph input, and
    cudagraph trees (reduce-overhead) treat a graph input that is neither a parameter, a buffer nor
    marked static as one to copy into the graph's own memory at every replay, and refuse to record a
    graph for a function that writes one in place (torch/_inductor/cudagraph_utils.py,
    `check_for_mutation`: "skipping cudagraphs due to mutated inputs"). The step writes every pool, so
    without the mark torch.compile records no graph for it (on the H200: tests/test_graphs.py). The pools
    are the same tensors for the runner's life (allocated once, written in place): static indeed."""
    for t in static:
        torch._dynamo.mark_static_address(t)


def inductor_options(backend: str, device: torch.device) -> dict:
    """Inductor's settings for a whole-step build: mode="reduce-overhead"'s own (cudagraph trees, on CUDA)
    and `reorder_for_locality` off.

    Why: that pass (inference graphs only, before reinplacing) moves a write into a state pool above an
    earlier read of the pool it does not depend on: the codec's history writes went above the conv kernel
    that reads the old history, and the reinplacing that follows must then keep the old pool, so every step
    built each history pool anew and copied it back. tests/test_compiled_writes.py checks that every pool
    the step writes is written in place."""
    options = dict(torch._inductor.list_mode_options("reduce-overhead")) if (
        backend == "reduce-overhead" and device.type == "cuda") else {}
    options["reorder_for_locality"] = False
    return options


def tracing_free_tensors_as_attributes(compiled):
    """`compiled` (a torch.compile'd function) traced with Dynamo's install_free_tensors: the model's weights,
    which the step reaches through its closure, become attributes of the traced graph instead of arguments
    Dynamo gathers at every call (the state pools, marked static, stay arguments).

    Why: the weights are ~1,200 tensors at full size; gathering them as arguments was about half of what a
    call cost the host once the guards were skipped (_run_prepared): with the tiny widths and the full layer
    counts on this project's CPU, 369 against 185 us a call, the graph's arguments 1,381 against 46
    (scripts/dev/compiled_host_cost.py). AOTAutograd still lifts them as the graph's parameters, so Inductor
    and cudagraph trees see the same inputs as before, static as parameters are."""
    if not hasattr(torch._dynamo.config, "install_free_tensors"):   # a torch without it: weights as arguments
        log.warning("this torch has no torch._dynamo.config.install_free_tensors: the compiled step takes its "
                    "weights as arguments (more host time per call)")
        return compiled

    @functools.wraps(compiled)
    def traced_with_attributes(*args):
        with torch._dynamo.config.patch(install_free_tensors=True):
            return compiled(*args)
    return traced_with_attributes


def cudagraph_skips() -> int:
    """Inductor's count of compiled functions that reduce-overhead ran without a CUDA graph (each skip
    is logged with its reason under TORCH_LOGS=cudagraphs)."""
    from torch._dynamo.utils import counters
    return int(counters["inductor"]["cudagraph_skips"])
