"""The compiled step writes every state pool in place.

A whole-step build (engine.graph_backend reduce-overhead or cudagraph) sees the state pools as graph inputs
that the step mutates. AOTAutograd traces the step functionally and ends the graph with `copy_(pool, new
value)` for each; Inductor's reinplacing then turns the functional write back into a write in place, and the
copy into a copy of the pool onto itself, which it drops. Where reinplacing fails, the new value is a whole
new pool, built and copied back at every step: a cost that grows with the pools (every call's whole KV), not
with the step. This test runs what Inductor runs before its code generation (AOTAutograd with Inductor's
decompositions, then its post-grad passes, reinplacing included, under the runner's Inductor options) on
the slim model's step (every kind of pool the tiny one has; tests/conftest.py), with the graph the GPU
traces (the ops' custom ops, the LLM's kernel path), and reads the epilogue: every copy back into a pool
must be the pool itself.

Two writes are kept in place by design: the LLM's KV write into one layer of its stacked pools (in torch, a
functional index_put and a select_scatter of the whole stack; hence the custom op nemo_duplex::kv_write) and
the codec's history writes, which Inductor's reorder_for_locality would move above the conv kernel's read of
the old history (off: graphs/compiled.py inductor_options). The second test shows the check finding the
latter with the pass on.
"""
from collections import Counter

import pytest
import torch

from graphs.compiled import inductor_options
from nemo_duplex.models.config import SamplingParams
from nemo_duplex.serving.frame_step import admit, special_ids
from nemo_duplex.serving.pages import whole_call_state
from nemo_duplex.serving.runner import build_runner
from nemo_duplex.serving.state import state_tensors
from tests.conftest import slim_model

CPU = torch.device("cpu")


class _Analysed(Exception):
    """Raised by the analysing compiler once it has read the graph: nothing is generated or run."""


def _epilogue_copies(model, st, reorder_for_locality: bool | None = None) -> tuple[Counter, list]:
    """(how many nodes of each op write in place, (pool shape, op that made the new value) of every pool
    copied back out of place) in the step's post-grad graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.post_grad import post_grad_passes
    from torch._inductor.virtualized import V

    found = {}

    def post_grad_only(gm, example_inputs):
        with V.set_fake_mode(detect_fake_mode(example_inputs)):
            post_grad_passes(gm, is_inference=True)
        copies = [n for n in gm.graph.nodes
                  if n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder"]
        found["writes"] = Counter(str(n.target) for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
                                  and any(a.alias_info is not None and a.alias_info.is_write
                                          for a in n.target._schema.arguments))
        found["out_of_place"] = [(tuple(n.args[0].meta["val"].shape), str(n.args[1].target))
                                 for n in copies if n.args[1] is not n.args[0]]
        return make_boxed_func(lambda *args: (_ for _ in ()).throw(_Analysed()))

    specials = special_ids(model, CPU)
    compiler = aot_autograd(fw_compiler=post_grad_only, decompositions=select_decomp_table(),
                            keep_inference_input_mutations=True)
    torch._dynamo.reset()
    runner = build_runner(model, st, specials, [2], graphs=True, backend="reduce-overhead", compiler=compiler)
    inputs = runner._padded_inputs(2, torch.tensor([0, 1]), torch.zeros(2, 1280), torch.tensor([-1, -1]))
    options = inductor_options("reduce-overhead", CPU)
    if reorder_for_locality is not None:
        options["reorder_for_locality"] = reorder_for_locality
    with torch._inductor.config.patch(options), pytest.raises(_Analysed):
        runner._compiled(*inputs, True)
    return found["writes"], found["out_of_place"]


@pytest.fixture(scope="module")
def gpu_graph_model():
    """The slim model with two attention layers in its LLM (the torch KV write's copies needed a stacked pool
    of more than one layer), as the GPU traces it: the LLM step on its kernel path (chosen at load on CUDA)."""
    model, _ = slim_model(llm_pattern="M**-")
    model.llm.use_kernels = True
    st = whole_call_state(model, 2, 8, CPU, 0, 16)
    for s in range(2):
        admit(model, st, s, None, s, SamplingParams())
    return model, st


@torch.no_grad()
@pytest.mark.triton_interpret   # the ops trace as their custom ops, as on the GPU
def test_compiled_step_writes_every_pool_in_place(gpu_graph_model):
    model, st = gpu_graph_model
    writes, out_of_place = _epilogue_copies(model, st)
    print(f"writes in place: {dict(writes)}; copied back: {out_of_place}")
    assert out_of_place == []
    # the LLM's KV writes among them: one key and one value write per attention layer
    attention_layers = len(model.cfg.llm.layer_indices("*"))
    assert writes["nemo_duplex.kv_write.default"] == 2 * attention_layers, writes


@torch.no_grad()
@pytest.mark.triton_interpret
def test_the_check_finds_a_pool_copied_back(gpu_graph_model):
    """With Inductor's reorder_for_locality on (its default), the codec's history writes (pools [slots, k-1,
    channels]) are built anew and copied back: the check above would say so."""
    model, st = gpu_graph_model
    _, out_of_place = _epilogue_copies(model, st, reorder_for_locality=True)
    histories = [tuple(v.shape) for name, v in state_tensors(st) if name.startswith("codec.convnext_history.")]
    assert sorted(shape for shape, _ in out_of_place) == sorted(histories), out_of_place
    assert {op for _, op in out_of_place} == {"aten.index_put.default"}, out_of_place
