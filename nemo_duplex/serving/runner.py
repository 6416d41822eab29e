"""The engine's step runner: `frame_step` over the state pools, wrapped for graphs/capture.py's StepRunner.

`FrameStep` is the function a runner captures: one batched frame step for rows of slots, as deep as the
pipeline (engine.pipeline), with the CUDA streams its halves run on and the SMs its text half leaves to
the others (engine.llm_sm_carveout). `build_runner` makes both from the engine settings; the app builds it
and hands it to the engine (serving/engine.py `build_engine`).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from graphs.capture import StepRunner, buckets_for, resolve_graphs, step_compiles
from graphs.compile_cache import CompileCache, cache_key
from nemo_duplex import REPO
from nemo_duplex.serving.admission_graphs import AdmissionGraphs
from nemo_duplex.serving.frame_step import frame_step
from nemo_duplex.serving.state import state_tensors

log = logging.getLogger(__name__)

# What the engine takes to the host after a step (StepOutput's `enc` stays on the device).
HOST_FIELDS = ("text", "func", "top2", "user", "codes", "pcm")


def check_sm_carveout(sms, device: torch.device, pipeline: int = 0, takes_carveout: bool = True,
                      backend: str = "") -> int:
    """engine.llm_sm_carveout as an int, or a ValueError naming its bounds (0 .. the device's SMs - 1).
    "auto": half the device's SMs where the step is two deep on CUDA and captured by hand or eager (the
    only steps whose GEMMs can take a carveout), else 0. Half because on the H200 (132 SMs) 64, 80 and 96
    gave the same step, 13.37-13.56 ms at N=32 against 13.93-14.05 without, and 16-48 SMs gained less; one
    deep and serial it neither helped nor hurt (docs/performance.md)."""
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
    if sms and not takes_carveout:
        raise ValueError("engine.llm_sm_carveout works with the hand capture (cudagraph-eager, cudagraph-regions) "
                         f"or eager steps, not engine.graph_backend={backend}")
    return sms


class FrameStep:
    """frame_step for rows of slots, as deep as `pipeline`: 1, each step's speech half is that of the rows'
    previous frames (frame_step's speech_slots); 2, also its text half (text_slots), the speech half two
    frames back. Every row carries a slot per half (the sink where its call has no frame for that half)."""

    def __init__(self, model, state, specials: torch.Tensor, pipeline: int = 0, streams: bool = False,
                 llm_sm_carveout: int = 0):
        self.model, self.state, self.specials = model, state, specials
        self.pipeline = int(pipeline)
        if self.pipeline not in (0, 1, 2):
            raise ValueError(f"engine.pipeline must be 0, 1 or 2 (false / true = 0 / 1), got {pipeline!r}")
        device = state.llm_len.device
        # frame_step's second stream (its `branch`), on CUDA when the step runs eagerly or is captured by
        # hand; not inside torch.compile's whole-step graphs, which would have to trace the stream switches
        self.side_stream = torch.cuda.Stream(device) if streams else None
        # the pipelined step's speech half, a third path beside the encoder + LLM chain and the side branch
        # (stream priorities, either way round, changed nothing measurable: docs/decisions.md)
        self.speech_stream = torch.cuda.Stream(device) if streams and self.pipeline else None
        # two deep: the listening half (encoder, RNN-T) on a fourth path; with it on the step's stream the
        # encoder's ~400 small kernels, slowed by the speech half beside them, were the chain's first 4 ms
        self.encoder_stream = torch.cuda.Stream(device) if streams and self.pipeline == 2 else None
        self.llm_sm_carveout = llm_sm_carveout

    def __call__(self, slots, audio, forced, speech, text, sampling: bool = True):
        halves = {}
        if self.pipeline >= 1:
            halves.update(speech_slots=speech, speech_stream=self.speech_stream)
        if self.pipeline == 2:
            halves.update(text_slots=text, encoder_stream=self.encoder_stream)
        return frame_step(self.model, self.state, slots, audio, forced, self.specials, sampling=sampling,
                          side_stream=self.side_stream, llm_sm_carveout=self.llm_sm_carveout, **halves)

    def describe(self) -> str:
        return f"pipeline {self.pipeline}, LLM SM carveout {self.llm_sm_carveout}"


def build_runner(model, state, specials: torch.Tensor, buckets: list[int], graphs=True,
                 backend: str = "reduce-overhead", compiler: str = "inductor", greedy_graphs: bool = False,
                 side_stream: bool = True, pad_eager: bool = False, pipeline: int = 0,
                 llm_sm_carveout=0, compile_cache: CompileCache | None = None,
                 dynamic_batch: bool | str = False) -> StepRunner:
    """A StepRunner of the frame step over `state` (the engine settings of the same names)."""
    device = state.llm_len.device
    captured = resolve_graphs(graphs, device)
    hand_run = not captured or backend.startswith("cudagraph")   # "cudagraph": compiled, captured by hand
    step = FrameStep(model, state, specials, pipeline, streams=side_stream and hand_run and device.type == "cuda")
    # the carveout is a process-wide setting flipped around the text half while it is queued: eager steps
    # and the hand capture of them take it, nothing torch.compile traces (reduce-overhead, cudagraph)
    takes = not captured or backend in ("cudagraph-eager", "cudagraph-regions")
    step.llm_sm_carveout = check_sm_carveout(llm_sm_carveout, device, step.pipeline, takes_carveout=takes,
                                             backend=backend)
    static = [t for _, t in state_tensors(state)] + [specials]
    return StepRunner(step, static, state.sink, model.cfg.samples_per_frame_in, device, buckets, graphs=graphs,
                      backend=backend, compiler=compiler, greedy_graphs=greedy_graphs, pad_eager=pad_eager,
                      host_fields=HOST_FIELDS, regions_root=model, label=step.describe(), compile_cache=compile_cache,
                      dynamic_batch=dynamic_batch)


def engine_runner(model, state, specials: torch.Tensor, cfg) -> StepRunner:
    """The runner an engine with settings `cfg` (EngineConfig) steps through: its capture buckets up to
    max_calls (only the one covering max_calls when batch_invariant, eager steps padded to it too)."""
    buckets = buckets_for(cfg.capture_buckets, cfg.max_calls)
    buckets = buckets[-1:] if cfg.batch_invariant else buckets
    return build_runner(model, state, specials, buckets,
                        graphs=cfg.graphs, backend=cfg.graph_backend, greedy_graphs=cfg.greedy_graphs,
                        side_stream=cfg.side_stream, pad_eager=cfg.batch_invariant, pipeline=cfg.pipeline,
                        llm_sm_carveout=cfg.llm_sm_carveout, dynamic_batch=cfg.compile_dynamic_batch,
                        compile_cache=engine_compile_cache(model, state.llm_len.device, cfg, buckets))


def engine_compile_cache(model, device: torch.device, cfg, buckets: list[int]) -> CompileCache | None:
    """The compile cache of engine.compile_cache_dir for a runner with settings `cfg` (EngineConfig), keyed by
    the code and by what it compiles: the back end, the buckets and their variants, the pipeline depth, the
    model's config (dimensions, dtypes) and the device. None where nothing compiles (a directory given
    then is named in a warning) or the setting is null."""
    where = cfg.compile_cache_dir
    compiles = step_compiles(resolve_graphs(cfg.graphs, device), cfg.graph_backend)   # StepRunner.compiles' rule
    if where is None:
        return None
    if not compiles:
        if where != "auto":
            log.warning("engine.compile_cache_dir=%s is unused: engine.graph_backend=%s (engine.graphs=%s) compiles "
                        "nothing", where, cfg.graph_backend, cfg.graphs)
        return None
    directory = REPO / "outputs" / "compile_cache" if where == "auto" else Path(where)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    parts = dict(backend=cfg.graph_backend, buckets=tuple(buckets), greedy_graphs=cfg.greedy_graphs,
                 dynamic_batch=cfg.compile_dynamic_batch,
                 pipeline=cfg.pipeline, side_stream=cfg.side_stream, model=repr(model.cfg), device=name)
    return CompileCache(directory, cache_key(parts, [REPO / "nemo_duplex", REPO / "graphs", REPO / "ops"]))


def admission_graphs(model, state, cfg) -> AdmissionGraphs:
    """The admission an engine with settings `cfg` runs: replayed from CUDA graphs (engine.prefill_graphs),
    else eagerly, op by op; either way the talker's warm-up is computed once per speaker and copied in."""
    device = state.llm_len.device
    choice = cfg.prefill_graphs
    if choice not in ("auto", True, False):
        raise ValueError(f"engine.prefill_graphs must be auto, true or false, got {choice!r}")
    on = resolve_graphs(cfg.graphs, device) if choice == "auto" else choice
    if on and device.type != "cuda":
        raise ValueError(f"engine.prefill_graphs=true needs CUDA; the engine runs on {device}")
    return AdmissionGraphs(model, state, cfg.prefill_chunk_tokens, graphs=bool(on))
