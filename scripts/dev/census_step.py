"""Kernel census of one frame step on the CPU: how many device ops each stage launches, by op name.

    TRITON_INTERPRET=1 python scripts/dev/census_step.py            # tiny model, the kernels' code paths
    TRITON_INTERPRET=1 python scripts/dev/census_step.py calls=4 layers=full   # the real layer counts

A captured step's time is mostly its launch count times a few microseconds (docs/performance.md,
"Where the time goes"), and the count does not need a GPU: this runs the tiny model through the same
ops (Triton kernels under the interpreter count as one op each, their insides are not counted) and
counts the leaf ATen ops per stage. Shape and view ops launch nothing and are left out; an op with a
fused CUDA kernel but a composite CPU one (torch.lstm_cell) counts as its CUDA launches. The talker's
and RNN-T's stages do not depend on the layer counts; the encoder's, LLM's and talker backbone's scale
with them (the tiny model has fewer layers than the real one: the per-layer count is what carries over).
"""
from __future__ import annotations

import collections
import dataclasses
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_duplex.checkpoint.random_weights import random_model  # noqa: E402
from nemo_duplex.models.config import ModelConfig, tiny_config  # noqa: E402
from nemo_duplex.serving import frame_step as step_module  # noqa: E402
from nemo_duplex.serving.state import allocate_call_state  # noqa: E402
from ops import torch_references  # noqa: E402

VIEWS = {"empty", "empty_like", "empty_strided", "as_strided", "as_strided_", "set_", "view", "_unsafe_view",
         "reshape", "_reshape_alias", "resize_", "resolve_conj", "expand", "unsqueeze", "squeeze", "t",
         "transpose", "permute", "slice", "select", "split", "split_with_sizes", "chunk", "unbind", "detach",
         "alias", "unflatten", "flatten", "narrow", "lift_fresh", "contiguous", "to", "_to_copy", "numpy_T",
         "result_type", "linear", "matmul", "einsum", "conv1d", "convolution", "_convolution", "dropout"}
# ops whose CPU implementation is a composite but whose CUDA one is fused: counted as their CUDA launches
FUSED_ON_CUDA = {"lstm_cell": 3}  # two GEMMs and one fused gate kernel
STAGES = ("encoder", "llm", "heads", "talker", "talker.backbone", "talker.generate", "codec", "rnnt")


def full_layer_counts(cfg):
    """The tiny model's dims with the real model's layer counts (24 encoder layers, the 56-letter LLM
    pattern, 28 talker layers): the per-layer stages then count what the full model launches."""
    full = ModelConfig()
    return dataclasses.replace(
        cfg, encoder=dataclasses.replace(cfg.encoder, n_layers=full.encoder.n_layers),
        llm=dataclasses.replace(cfg.llm, hybrid_override_pattern=full.llm.hybrid_override_pattern),
        talker=dataclasses.replace(cfg.talker, backbone=dataclasses.replace(
            cfg.talker.backbone, num_hidden_layers=full.talker.backbone.num_hidden_layers)))


def census(calls: int = 2, full_layers: bool = False) -> dict[str, collections.Counter]:
    cfg = full_layer_counts(tiny_config()) if full_layers else tiny_config()
    # Built with the ops' torch references: the build is not counted, and under the interpreter the talker's
    # per-token table (the char encoder over every token) took ~100 s of it. Then the codec's GEMM weights
    # are split again as the kernels' path wants them (presplit_weights builds them only where it runs).
    with torch_references():
        model = random_model(cfg, seed=0)[0].cast_for_inference().eval()   # as runtime.load serves it
    model.codec.presplit_weights()
    # the GPU's code paths where the CPU would take the torch ones: the LLM's Mamba and attention kernels
    # (chosen once at load by device); the talker's decode attention takes its kernel under the interpreter
    model.llm.use_kernels = True
    return _count(model, cfg, calls)


def _count(model, cfg, calls: int) -> dict[str, collections.Counter]:
    talker = model.talker
    for obj, name, label in ((talker.backbone, "step", "talker.backbone"), (talker, "generate_step", "talker.generate")):
        inner = getattr(obj, name)

        def wrapped(*args, _inner=inner, _label=label, **kwargs):
            with record_function(_label):
                return _inner(*args, **kwargs)
        setattr(obj, name, wrapped)
    st = allocate_call_state(model, calls, 16, "cpu", max_prompt_tokens=0)
    slots = torch.arange(calls)
    audio = torch.randn(calls, cfg.samples_per_frame_in, generator=torch.Generator().manual_seed(0)) * 0.1
    forced = torch.full((calls,), -1)
    specials = step_module.special_ids(model, "cpu")
    with torch.no_grad():
        # the first step prepares what later steps reuse; it is not counted, so it takes the torch
        # references (under the interpreter it cost as much as the counted step)
        with torch_references():
            step_module.frame_step(model, st, slots, audio, forced, specials)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step_module.frame_step(model, st, slots, audio, forced, specials)
    events = list(prof.events())
    ranges = {e.name: e.time_range for e in events if e.name in STAGES}
    kernels = [e.time_range for e in events
               if e.name.startswith("nemo_duplex::") or e.name[6:] in FUSED_ON_CUDA]

    def inside(r, outer):
        return outer.start <= r.start and r.end <= outer.end

    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        r = e.time_range
        if e.name.startswith("nemo_duplex::") or e.name[6:] in FUSED_ON_CUDA:
            if any(k is not r and inside(r, k) for k in kernels):
                continue
        elif (not e.name.startswith("aten::") or e.name[6:] in VIEWS or any(inside(r, k) for k in kernels)
              or any(c.name.startswith("aten::") and c.name[6:] not in VIEWS for c in e.cpu_children)):
            continue
        stage = min((s for s, sr in ranges.items() if inside(r, sr)),
                    key=lambda s: ranges[s].elapsed_us(), default="other")
        name = e.name.split("::", 1)[1]
        counts[stage][name] += FUSED_ON_CUDA.get(name, 1)
    return counts


def main() -> None:
    calls = int(next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("calls=")), 2))
    full = "layers=full" in sys.argv[1:]
    counts = census(calls, full_layers=full)
    total = sum(sum(c.values()) for c in counts.values())
    what = "the tiny model with the full layer counts" if full else "the tiny model"
    print(f"{total} device ops in one frame step of {what} ({calls} calls); innermost stage wins")
    for stage, c in sorted(counts.items(), key=lambda kv: -sum(kv[1].values())):
        top = ", ".join(f"{name} {n}" for name, n in c.most_common(10))
        print(f"{stage:>16}: {sum(c.values()):5d}  {top}")


if __name__ == "__main__":
    main()
