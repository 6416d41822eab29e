"""Captured frame steps, one per batch bucket.

`StepRunner` runs `frame_step` for a batch of calls: it pads the batch to the next capture bucket with
rows that point at the sink slot (so padding touches no real call), replays that bucket's graph, and
returns the real rows. Buckets are captured at start-up, largest first, never while serving. A batch
above the largest bucket is split into groups of at most the largest bucket, each replayed. With
`graphs=False` the very same function runs eagerly, so graphs on and off compute the same thing (eager
steps run the batch's own rows, or, with `pad_eager`, the same padded rows and groups as the graphs).

Batch invariance (`engine.batch_invariant`: one bucket, eager steps padded too): every step then runs the
same number of rows, so every kernel choice that follows the row count (on the GPU cuBLASLt's split-K,
cuDNN's convolution algorithm, the decode attention's split count) is the same whatever shares the step,
and a call's outputs are the same bit for bit alone or beside others: on the H200 at full size in bf16
(tests/test_graphs.py; with several buckets they are not) and on the CPU (tests/test_engine.py).

Three capture back ends (`engine.graph_backend`):
- "cudagraph-eager" (default): the step as written, captured by hand with `torch.cuda.CUDAGraph` into
  static input buffers. Seconds to capture. The fusion Inductor would bring is done by hand instead:
  ops/ kernels for the norms (with the talker's rotary), the attention, the Mamba step, the RNG and the
  codec GEMMs, which took the step from ~7,300 to ~3,600 kernels (docs/performance.md).
- "cudagraph-regions": the same hand capture, with the step's pure small-op pieces (the talker's MoG
  passes, the RNN-T symbol loop) compiled by Inductor on their own (graphs/regions.py). About 1 ms a
  step faster at full size, but its bf16 codes part from the plain step's (graphs/regions.py says why).
- "reduce-overhead": `torch.compile(mode="reduce-overhead", fullgraph=True)`; Inductor fuses the
  pointwise work and cudagraph trees record a CUDA graph per shape; the pools are closed over, marked as
  static inputs (mark_static_inputs: without the mark no graph was recorded) and written in place.
- "cudagraph": `torch.compile` (default mode) for fusion, captured by hand as above.
Why the hand capture serves: at full size on the H200 (torch 2.11), N=32 at position 1000, the sampling
variant, on one lease (session 16): reduce-overhead 22.75 ms a step, with 3.66 ms of host work per step (not
profiled; Dynamo's guards and cudagraph trees' checks run over the graph's 1,385 inputs at every call, and
the step's GPU time includes the wait for them), against 18.18 ms and 0.74 ms for the hand capture. Its
build of one bucket took 71 s, so the serving default's 20 buckets (conf/config.yaml) would take about 20 x
71 s at start-up, twice that with `greedy_graphs` (not measured). Earlier builds never ended: session 2's
failed in Inductor's code generation for the sampler's cumsum over 131,072 logits (now a custom op,
sampling.nucleus_draw); session 15's was still lowering when stopped at 7 minutes, and session 16's stack
samples put it inside the string torch 2.11 makes of an implicit fallback's arguments from minute 2 to
minute 10 (graphs/fallbacks.py, which registers the ops first). The Triton kernels are custom ops (opaque to
torch.compile), so the compiled back ends keep fullgraph=True; they compile and match eager on the CPU
(tests/test_graphs.py, aot_eager and Inductor) and, at tiny size, reduce-overhead on the GPU.
On a CPU there are no graphs: the compiled back ends still compile (Inductor's C++ back end, or
`compiler="aot_eager"`, which the CPU graphs-vs-eager test uses to trace the same graph cheaply).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields

import numpy as np
import torch

from graphs.fallbacks import register_inductor_fallbacks
from graphs.regions import install_regions
from nemo_duplex.serving.frame_step import StepOutput, frame_step
from nemo_duplex.serving.state import state_tensors

log = logging.getLogger(__name__)

# What the engine takes to the host after a step (the rest of StepOutput stays on the device).
HOST_FIELDS = ("text", "func", "top2", "user", "codes", "pcm")
NUMPY_DTYPES = {torch.int64: np.int64, torch.float32: np.float32}


BACKENDS = ("cudagraph-eager", "cudagraph-regions", "reduce-overhead", "cudagraph")


def buckets_for(configured, max_calls: int) -> list[int]:
    """The capture buckets worth recording for at most max_calls rows: those below max_calls, then the
    smallest one at or above it (max_calls itself if none is). A bucket above that would never be used
    and costs a capture at start-up."""
    sizes = sorted(set(int(b) for b in configured))
    below = [b for b in sizes if b < max_calls]
    return below + [next((b for b in sizes if b >= max_calls), max_calls)]


def mark_static_inputs(state, specials: torch.Tensor) -> None:
    """Mark every state pool (and the special-token ids) as a static address for torch.compile.

    Why: the step reaches the pools through `self.state`, so Dynamo lifts each one into a graph input,
    and cudagraph trees (reduce-overhead) treat a graph input that is neither a parameter, a buffer nor
    marked static as one to copy into the graph's own memory at every replay, and refuse to record a
    graph for a function that writes one in place (torch/_inductor/cudagraph_utils.py,
    `check_for_mutation`: "skipping cudagraphs due to mutated inputs"). The step writes every pool, so
    without the mark torch.compile records no graph for it (on the H200: tests/test_graphs.py). The pools
    are the same tensors for the runner's life (allocated once, written in place): static indeed."""
    for _, t in state_tensors(state):
        torch._dynamo.mark_static_address(t)
    torch._dynamo.mark_static_address(specials)


def check_sm_carveout(sms, device: torch.device, pipeline: int = 0, takes_carveout: bool = True) -> int:
    """engine.llm_sm_carveout as an int, or a ValueError naming its bounds (0 .. the device's SMs - 1).
    "auto": half the device's SMs where the step is two deep on CUDA and captured by hand or eager (the
    only steps whose GEMMs can take a carveout: StepRunner), else 0. Half because on the H200 (132 SMs)
    64, 80 and 96 gave the same step, 13.37-13.56 ms at N=32 against 13.93-14.05 without, and 16-48 SMs
    gained less; one deep and serial it neither helped nor hurt (docs/performance.md, session 21)."""
    total = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    if sms == "auto":
        usable = (total is not None and pipeline == 2 and takes_carveout
                  and hasattr(torch._C, "_set_sm_carveout_experimental"))
        return total // 2 if usable else 0
    try:
        sms = int(sms)
    except (TypeError, ValueError):
        raise ValueError(f"engine.llm_sm_carveout must be auto or an int, got {sms!r}") from None
    if sms < 0 or (total is not None and sms >= total):
        raise ValueError(f"engine.llm_sm_carveout must be 0 .. {total - 1 if total else 'the SMs - 1'}, got {sms}")
    if sms and not hasattr(torch._C, "_set_sm_carveout_experimental"):
        raise ValueError(f"engine.llm_sm_carveout needs torch's SM carveout (torch {torch.__version__} has none)")
    return sms


def cudagraph_skips() -> int:
    """Inductor's count of compiled functions that reduce-overhead ran without a CUDA graph (each skip
    is logged with its reason under TORCH_LOGS=cudagraphs)."""
    from torch._dynamo.utils import counters
    return int(counters["inductor"]["cudagraph_skips"])


class StepRunner:
    takes_sampling_flag = True  # step_to_host passes `sampling` (test stand-ins do not take it)

    def __init__(self, model, state, specials: torch.Tensor, buckets: list[int], graphs: bool | str = True,
                 backend: str = "reduce-overhead", compiler: str = "inductor", greedy_graphs: bool = False,
                 side_stream: bool = True, pad_eager: bool = False, pipeline: int = 0, llm_sm_carveout: int | str = 0):
        self.model, self.state, self.specials = model, state, specials
        # pipeline (engine.pipeline): 1, each step's speech half is that of the rows' previous frames
        # (frame_step's speech_slots); 2, also its text half (text_slots), the speech half two frames back.
        # Every row then carries a slot per half (the sink where its call has no frame for that half).
        self.pipeline = int(pipeline)
        if self.pipeline not in (0, 1, 2):
            raise ValueError(f"engine.pipeline must be 0, 1 or 2 (false / true = 0 / 1), got {pipeline!r}")
        self.pad_eager = pad_eager  # eager steps padded to the buckets as the graphs are (batch invariance)
        # greedy_graphs: every bucket also gets a variant for batches of greedy calls only (frame_step's
        # sampling=False: no sort over the vocabulary), at twice the captures; the general one serves all
        self.variants = (True, False) if greedy_graphs else (True,)
        self.buckets = sorted(set(int(b) for b in buckets))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"engine.capture_buckets must be positive sizes, got {buckets}")
        self.device = state.llm_len.device
        # "auto": captured on CUDA (the serving path), eager on the CPU (no graphs there)
        if graphs not in ("auto", True, False):
            raise ValueError(f"engine.graphs must be auto, true or false, got {graphs!r}")
        self.graphs = self.device.type == "cuda" if graphs == "auto" else bool(graphs)
        self.backend = backend
        self.sink = state.sink
        self._compiled = None
        self._cuda_graphs: dict[tuple, tuple] = {}  # (bucket, sampling) -> graph, static inputs, outputs
        self._graph_pool = None  # shared by every bucket's graph (_capture_cuda_graph)
        self._staging: dict[tuple, tuple] = {}  # per captured (bucket, sampling): pinned host twins of in/outputs
        self._inputs: dict[int, tuple] = {}     # per bucket: static inputs, shared by its variants
        self.capture_seconds: dict[int, float] = {}
        # per captured (bucket, sampling): its first and second replay at capture (_capture_cuda_graph), ms
        self.replay_ms: dict[tuple, tuple[float, float]] = {}
        self.regions = []
        # frame_step's second stream (its `branch`), on CUDA when the step runs eagerly or is captured by
        # hand; not inside torch.compile's whole-step graphs, which would have to trace the stream switches
        hand_run = not self.graphs or backend.startswith("cudagraph")
        streams = side_stream and hand_run and self.device.type == "cuda"
        self.side_stream = torch.cuda.Stream(self.device) if streams else None
        # the pipelined step's speech half, a third path beside the encoder + LLM chain and the side branch
        # (stream priorities, either way round, changed nothing measurable: docs/performance.md, sessions 19-20)
        self.speech_stream = torch.cuda.Stream(self.device) if streams and self.pipeline else None
        # two deep: the listening half (encoder, RNN-T) on a fourth path; with it on the step's stream the
        # encoder's ~400 small kernels, slowed by the speech half beside them, were the chain's first 4 ms
        # (docs/performance.md, session 20)
        self.encoder_stream = torch.cuda.Stream(self.device) if streams and self.pipeline == 2 else None
        if backend not in BACKENDS:
            raise ValueError(f"engine.graph_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        # the carveout is a process-wide setting flipped around the text half while it is queued: eager steps
        # and the hand capture of them take it, nothing torch.compile traces (reduce-overhead, cudagraph)
        takes_carveout = not self.graphs or backend in ("cudagraph-eager", "cudagraph-regions")
        self.llm_sm_carveout = check_sm_carveout(llm_sm_carveout, self.device, self.pipeline, takes_carveout)
        if self.llm_sm_carveout and not takes_carveout:
            raise ValueError("engine.llm_sm_carveout works with the hand capture (cudagraph-eager, cudagraph-regions) "
                             f"or eager steps, not engine.graph_backend={backend}")
        if self.graphs and backend == "cudagraph-eager":
            self._compiled = self._eager
        elif self.graphs and backend == "cudagraph-regions":
            self.regions = install_regions(model, compiler)  # compiled on the capture's warm-up calls
            self._compiled = self._eager
        elif self.graphs:
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                        4 * len(self.buckets) * len(self.variants))
            mark_static_inputs(state, specials)
            register_inductor_fallbacks()
            mode = "reduce-overhead" if backend == "reduce-overhead" and self.device.type == "cuda" else None
            # compiler "aot_eager" traces the same graph but runs it with eager kernels: the CPU test of
            # graphs-vs-eager uses it, since Inductor's C++ build of the whole step takes minutes there
            self._compiled = torch.compile(self._eager, mode=mode if compiler == "inductor" else None,
                                           backend=compiler, fullgraph=True, dynamic=False)

    def _eager(self, slots: torch.Tensor, audio: torch.Tensor, forced: torch.Tensor,
               speech: torch.Tensor | None = None, text: torch.Tensor | None = None,
               sampling: bool = True) -> StepOutput:
        return self._step(slots, audio, forced, speech, text, sampling)

    def _step(self, slots, audio, forced, speech, text, sampling: bool) -> StepOutput:
        """frame_step for the rows, as deep as `pipeline` (speech, text: the rows' slots on those halves;
        None: the rows' own slots)."""
        halves = {}
        if self.pipeline >= 1:
            halves.update(speech_slots=slots if speech is None else speech, speech_stream=self.speech_stream)
        if self.pipeline == 2:
            halves.update(text_slots=slots if text is None else text, encoder_stream=self.encoder_stream)
        return frame_step(self.model, self.state, slots, audio, forced, self.specials, sampling=sampling,
                          side_stream=self.side_stream, llm_sm_carveout=self.llm_sm_carveout, **halves)

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
        n_in = self.model.cfg.samples_per_frame_in
        skips = cudagraph_skips()
        for b in sorted(self.buckets, reverse=True):
            t0 = time.perf_counter()
            for sampling in self.variants:
                if self.backend.startswith("cudagraph") and self.device.type == "cuda":
                    self._capture_cuda_graph(b, sampling)
                else:
                    none = torch.empty(0, dtype=torch.int64)
                    inputs = self._padded_inputs(b, none, torch.empty(0, n_in), none)
                    for _ in range(3):  # compile, then (reduce-overhead) warm up and record the graph
                        self._compiled(*inputs, sampling)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.capture_seconds[b] = time.perf_counter() - t0
            replays = ", ".join("%.1f / %.1f" % self.replay_ms[(b, v)] for v in self.variants if (b, v) in self.replay_ms)
            log.info("captured bucket %d (%s, pipeline %d, LLM SM carveout %d) in %.1f s; first / second replay %s ms",
                     b, self.backend, self.pipeline, self.llm_sm_carveout, self.capture_seconds[b], replays or "-")
            if self.backend == "reduce-overhead" and self.device.type == "cuda" and cudagraph_skips() > skips:
                raise RuntimeError(f"engine.graph_backend=reduce-overhead recorded no CUDA graph for bucket {b} "
                                   "(torch.compile skipped it; TORCH_LOGS=cudagraphs says why)")

    def _staged_inputs(self, b: int):
        """A bucket's static inputs as views of ONE device buffer, with a pinned host twin: a step then
        moves its inputs with one copy (step_to_host). Audio first, so every view stays aligned."""
        n_in = self.model.cfg.samples_per_frame_in
        nbytes = b * n_in * 4 + 4 * b * 8
        device_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

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

    def _capture_cuda_graph(self, b: int, sampling: bool = True) -> None:
        if b not in self._inputs:
            self._inputs[b] = self._staged_inputs(b)
        static, staging = self._inputs[b]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._compiled(*static, sampling)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # One memory pool for every bucket: the graphs replay one at a time on one stream and each
        # replay's outputs are copied out before the next (__call__), so a bucket may reuse the memory of
        # another's intermediates. Private pools would cost one step's activations per bucket.
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = self._compiled(*static, sampling)
            # the fields the engine takes to the host, packed into one buffer inside the graph: one copy out
            packed = torch.cat([getattr(out, k).reshape(b, -1).contiguous().view(torch.uint8).reshape(-1)
                                for k in HOST_FIELDS])
        if self._graph_pool is None:
            self._graph_pool = graph.pool()
        host_out = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
        views, offset, flat = {}, 0, host_out.numpy()
        for k in HOST_FIELDS:
            t = getattr(out, k)
            nbytes = t.numel() * t.element_size()
            views[k] = flat[offset: offset + nbytes].view(NUMPY_DTYPES[t.dtype]).reshape(t.shape)
            offset += nbytes
        self._cuda_graphs[(b, sampling)] = (graph, *static, out)
        self._staging[(b, sampling)] = staging + (packed, host_out, views)
        # Replay once now, on the sink rows the static inputs still hold, so that whatever a graph's first
        # launch costs (its upload to the device) is paid at start-up, not by the first calls in a bucket.
        # Measured (session 5): the first replay here takes 0.3-1.3 ms more than the second, so this is not
        # what made one step of a load run take 221 ms (194 ms of device time for 13 rows, the first step
        # of 128 lockstep calls; still unexplained); the run after this change had no such step (first
        # audio p50 67 ms against 498 ms), one run each (docs/performance.md).
        times = []
        for _ in range(2):  # the second replay, for comparison in the log
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        self.replay_ms[(b, sampling)] = (times[0], times[1])

    def variant(self, b: int, sampling: bool) -> tuple[int, bool]:
        """The captured graph for a batch in bucket b: the greedy-only one when the batch is all greedy
        and it was captured, else the general one (exact for greedy rows too)."""
        return (b, False) if not sampling and (b, False) in self._cuda_graphs else (b, True)

    @torch.no_grad()
    def __call__(self, slots: torch.Tensor, audio: torch.Tensor, forced: torch.Tensor,
                 sampling: bool = True, speech: torch.Tensor | None = None,
                 text: torch.Tensor | None = None) -> StepOutput:
        """`sampling=False`: the caller vouches that every row is greedy (frame_step). `speech`, `text`: the
        rows' slots on those halves when pipelined (None: the rows' own slots)."""
        n = slots.shape[0]
        speech = slots if speech is None else speech
        text = slots if text is None else text
        if not self.graphs and not self.pad_eager:
            return self._step(slots.to(self.device), audio.to(self.device), forced.to(self.device),
                              speech.to(self.device), text.to(self.device), sampling)
        sampling = sampling or False not in self.variants  # only what capture() prepared, never a new compile
        largest = self.buckets[-1]
        if n > largest:  # groups of at most the largest bucket, each replayed
            parts = [self(slots[i: i + largest], audio[i: i + largest], forced[i: i + largest], sampling,
                          speech[i: i + largest], text[i: i + largest]) for i in range(0, n, largest)]
            return StepOutput(**{fl.name: torch.cat([getattr(p, fl.name) for p in parts]) for fl in fields(StepOutput)})
        b = self.bucket_for(n)
        key = self.variant(b, sampling)
        if key in self._cuda_graphs:
            graph, *static, out = self._cuda_graphs[key]
            for buf, new in zip(static, self._padded_inputs(b, slots, audio, forced, speech, text)):
                buf.copy_(new)
            graph.replay()
        else:
            out = (self._compiled or self._eager)(*self._padded_inputs(b, slots, audio, forced, speech, text),
                                                  sampling)
        # a replayed graph reuses its output memory on the next replay: copy the real rows out now
        return StepOutput(**{fl.name: getattr(out, fl.name)[:n].clone() for fl in fields(StepOutput)})


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
    outputs: dict[str, np.ndarray]   # HOST_FIELDS, first dim = the batch's rows, owned by the caller
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


def step_to_host(runner, slots: np.ndarray, audio: np.ndarray, forced: np.ndarray,
                 sampling: bool = True, speech: np.ndarray | None = None, text: np.ndarray | None = None,
                 events=None) -> HostStep:
    """One step of `runner` (a StepRunner, or anything called like one) for rows slots [n] int64, audio
    [n, 1280] float32, forced [n] int64, speech and text slots [n] int64 (pipelined runners; None = slots);
    `sampling=False` when every row is greedy. A StepRunner's
    captured buckets take the staged path; anything else (eager, compiled back ends, test doubles and
    wrappers) runs `runner(...)` and copies out. `events` (two CUDA timing events, staged path only): recorded
    just before the step's input copy and just after its output copy are queued (scripts/bench_step.py)."""
    n = len(slots)
    if getattr(runner, "_staging", None):   # (duck-typed: tests stand doubles in for StepRunner)
        largest = runner.buckets[-1]
        key = runner.variant(runner.bucket_for(n), sampling) if n <= largest else None
        if key in runner._staging:
            return _staged_step(runner, key, slots, audio, forced, slots if speech is None else speech,
                                slots if text is None else text, events)
        if n > largest:  # groups of at most the largest bucket, each its own staged step
            part = lambda rows, i: None if rows is None else rows[i: i + largest]  # noqa: E731
            parts = [step_to_host(runner, slots[i: i + largest], audio[i: i + largest], forced[i: i + largest],
                                  sampling, part(speech, i), part(text, i))
                     for i in range(0, n, largest)]
            return HostStep({k: np.concatenate([p.outputs[k] for p in parts]) for k in HOST_FIELDS},
                            parts[-1].launched, sum(p.padded_rows for p in parts))
    args = (torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)),
            torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32)),
            torch.from_numpy(np.ascontiguousarray(forced, dtype=np.int64)))
    if getattr(runner, "takes_sampling_flag", False):
        extra = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64))
                 for k, v in (("speech", speech), ("text", text)) if v is not None}
        out = runner(*args, sampling=sampling, **extra)
    else:
        out = runner(*args)
    launched = time.perf_counter()
    host = to_host([getattr(out, k) for k in HOST_FIELDS])
    padded = runner.padded_rows(n) if hasattr(runner, "padded_rows") else n
    return HostStep({k: t.numpy() for k, t in zip(HOST_FIELDS, host)}, launched, padded)


def _staged_step(runner: StepRunner, key: tuple[int, bool], slots, audio, forced, speech, text,
                 events=None) -> HostStep:
    graph = runner._cuda_graphs[key][0]
    device_in, host_in, (s, a, f, ss, ts), packed, host_out, views = runner._staging[key]
    b = key[0]
    n = len(slots)
    s[:n], s[n:] = slots, runner.sink   # padding rows: the sink on every half, silence, nothing forced
    a[:n], a[n:] = audio, 0.0
    f[:n], f[n:] = forced, -1
    ss[:n], ss[n:] = speech, runner.sink
    ts[:n], ts[n:] = text, runner.sink
    if events is not None:
        events[0].record()
    device_in.copy_(host_in, non_blocking=True)
    graph.replay()
    host_out.copy_(packed, non_blocking=True)
    if events is not None:
        events[1].record()
    launched = time.perf_counter()
    torch.cuda.current_stream(runner.device).synchronize()
    # copies: the pinned buffers are overwritten by the bucket's next step
    return HostStep({k: views[k][:n].copy() for k in HOST_FIELDS}, launched, b)
