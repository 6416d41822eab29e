"""What a torch.compile'd frame step costs the host per call before any kernel runs: Dynamo's guards and
the calling of the build with its inputs; with every guard evaluated and with only those that tell the
builds apart (graphs/capture.py StepRunner._run_prepared); with the weights traced as graph attributes (as
the runner does) or as arguments (`--free-tensors-as-arguments`). The build is traced as Inductor's would
be (AOTAutograd, input mutations kept in the graph) but its forward only returns the outputs of its first
run, so the time measured is the host's alone. Runs on the CPU: the model has the tiny widths and the full
model's layer counts (the step's weights and pools are as many tensors as at full size), so the guards are
those of the full model.

    python scripts/dev/compiled_host_cost.py [--calls 300] [--layers tiny] [--free-tensors-as-arguments]
"""
import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_duplex.checkpoint.random_weights import random_model  # noqa: E402
from nemo_duplex.models.config import SamplingParams, preset, tiny_config  # noqa: E402
from nemo_duplex.serving.frame_step import admit, special_ids  # noqa: E402
from nemo_duplex.serving.pages import whole_call_state  # noqa: E402
from nemo_duplex.serving.runner import build_runner  # noqa: E402
from ops import torch_references  # noqa: E402


def full_layer_counts(cfg):
    """The tiny configuration with the release model's layer counts (encoder, LLM pattern, talker)."""
    full = preset("nemotron_duplex")
    backbone = dataclasses.replace(cfg.talker.backbone, num_hidden_layers=full.talker.backbone.num_hidden_layers)
    return dataclasses.replace(
        cfg, encoder=dataclasses.replace(cfg.encoder, n_layers=full.encoder.n_layers),
        llm=dataclasses.replace(cfg.llm, hybrid_override_pattern=full.llm.hybrid_override_pattern),
        talker=dataclasses.replace(cfg.talker, backbone=backbone))


def cached_forward_compiler():
    """A torch.compile back end: AOTAutograd as Inductor runs it, with a forward that returns its first
    run's outputs from then on."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def forward(gm, example_inputs):
        first = []

        def run(*args):
            if not first:
                first.append(gm(*args))
            return first[0]
        return make_boxed_func(run)
    return aot_autograd(fw_compiler=forward, keep_inference_input_mutations=True)


def median_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--layers", choices=["full", "tiny"], default="full",
                    help="the release model's layer counts or the tiny one's")
    ap.add_argument("--free-tensors-as-arguments", action="store_true",
                    help="trace the weights and pools as arguments, not graph attributes (StepRunner's earlier build)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = full_layer_counts(tiny_config()) if args.layers == "full" else tiny_config()
    cpu = torch.device("cpu")
    with torch_references():
        model, _, _ = random_model(cfg, cpu, seed=0)
        model = model.cast_for_inference().eval()
        st = whole_call_state(model, 4, args.calls + 100, cpu, 0, 16)
        for slot in range(4):
            admit(model, st, slot, None, slot, SamplingParams())
        seen = []
        compiler = cached_forward_compiler()
        runner = build_runner(model, st, special_ids(model, cpu), [4], graphs=True, backend="reduce-overhead",
                              compiler=lambda gm, inputs: seen.append(len(inputs)) or compiler(gm, inputs))
        if args.free_tensors_as_arguments:
            runner._compiled = runner._built
        runner.capture()
        static = runner._inputs[4][0]   # the bucket's staged inputs, which capture() built on
        every = median_us(lambda: runner._compiled(*static, True), args.calls)
        apart = median_us(lambda: runner._run_prepared(*static, True), args.calls)
        rows = [t.numpy() for t in (torch.arange(2), torch.zeros(2, cfg.samples_per_frame_in), torch.full((2,), -1))]
        call = median_us(lambda: runner(*map(torch.from_numpy, rows)), args.calls)
        staged = median_us(lambda: runner.step_to_host(*rows), args.calls)
    print(f"layers: {args.layers}; the build's tensor inputs: {seen[0]}")
    print(f"host per call, every guard evaluated: {every:.0f} us")
    print(f"host per call, only the guards between builds (_run_prepared): {apart:.0f} us")
    print(f"a step of 2 rows, through runner(...): {call:.0f} us; through step_to_host (staged, numpy in and out): "
          f"{staged:.0f} us")


if __name__ == "__main__":
    main()
