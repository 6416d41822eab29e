"""The step's weight reads (nemo_duplex/serving/weight_reads.py), which the benchmark's floor counts: every GEMM
weight the step multiplies by in full, the embedding tables only by the rows a call gathers, nothing of
what runs only at admission (the codec's encoder, the talker's prompt projection)."""
import contextlib

import pytest
import torch

from nemo_duplex.models.config import SamplingParams
from nemo_duplex.serving.frame_step import admit, special_ids
from nemo_duplex.serving.state import allocate_call_state
from nemo_duplex.serving.weight_reads import (
    CountWeightReads,
    _extent,
    _merged_bytes,
    fixed_and_per_call,
    step_weight_reads,
)


def test_extents_and_merging():
    storage = torch.zeros(6, 8)
    assert _extent(storage) == (0, 6 * 8 * 4)
    assert _extent(storage.t()) == (0, 6 * 8 * 4)                 # a transposed weight spans all of it
    assert _extent(storage[2:4]) == (2 * 8 * 4, 4 * 8 * 4)         # a row slice, its rows only
    assert _extent(storage[:, 3]) == (3 * 4, (5 * 8 + 3 + 1) * 4)  # a column: first to last element
    assert _merged_bytes([(0, 10), (5, 20), (30, 40), (32, 35)]) == 30
    assert _merged_bytes([(30, 40), (0, 10), (10, 12)]) == 22


def test_counts_reads_not_views_and_rows_gathered():
    model = torch.nn.ModuleDict({"lin": torch.nn.Linear(8, 6, bias=False), "emb": torch.nn.Embedding(100, 4)})
    x = torch.randn(3, 8)
    with CountWeightReads(model) as counter:
        half = model["lin"].weight[:3]          # a view: nothing read yet
        torch.empty_like(model["lin"].weight)   # shaped like it: nothing read
    assert counter.reads.total == 0
    with CountWeightReads(model) as counter:
        half @ x.T                              # rows 0..2 of the weight
        x @ half.T                              # the same rows again: counted once
        model["emb"](torch.tensor([5, 7, 5]))   # three rows gathered (an upper bound: 5 repeats)
    assert counter.reads.by_tensor() == {"lin.weight": 3 * 8 * 4, "emb.weight": 3 * 4 * 4}
    with CountWeightReads(model) as counter:
        model["lin"](x)
        model["lin"](x)                         # read twice, counted once
    assert counter.reads.total == 6 * 8 * 4


def _state(model, calls=2):
    st = allocate_call_state(model, calls, 16, torch.device("cpu"), max_prompt_tokens=0)
    for slot in range(calls):
        admit(model, st, slot, None, slot, SamplingParams())
    return st


def test_step_reads_the_gemm_weights_in_full_and_gathers_rows(tiny):
    model = tiny[0]
    st = _state(model)
    slots = torch.arange(2, dtype=torch.int64)
    reads = step_weight_reads(model, st, special_ids(model, "cpu"), slots).by_tensor()
    named = dict(model.named_parameters())
    # every LLM Linear (Mamba in/out projections, MLPs, attention) and the heads: read whole. Linears stacked
    # into one tensor (the attention's q/k/v, nemo_duplex/models/stacking.py) are one read of the stack, counted under
    # the first of them (the counter names a storage by its first parameter)
    by_storage: dict[int, list[str]] = {}
    for name, module in [*model.llm.named_modules(prefix="stt_model.llm"),
                         ("stt_model.lm_head", model.stt_model.lm_head)]:
        if isinstance(module, torch.nn.Linear):
            by_storage.setdefault(named[f"{name}.weight"].untyped_storage().data_ptr(), []).append(f"{name}.weight")
    assert any(len(names) == 3 for names in by_storage.values())   # the stacked q/k/v
    for names in by_storage.values():
        assert reads.get(names[0]) == sum(named[n].numel() * named[n].element_size() for n in names), names
        assert not any(n in reads for n in names[1:]), names
    # the embedding table: the previous text and function token of each call, 2 rows per call
    table = model.stt_model.embed_tokens.weight
    row = table.shape[1] * table.element_size()
    assert reads["stt_model.embed_tokens.weight"] == 2 * 2 * row < table.numel() * table.element_size()
    # admission-only weights: not read by a step
    for name in named:
        if name.startswith(("tts_model.audio_codec.encoder.", "tts_model.tts_model.audio_prompt_projection_W")):
            assert name not in reads, name


def test_fixed_and_per_call_add_up(tiny):
    model = tiny[0]
    st = _state(model, calls=3)
    specials = special_ids(model, "cpu")
    fixed, per_call, one = fixed_and_per_call(model, st, specials, torch.device("cpu"))
    three = step_weight_reads(model, st, specials, torch.arange(3, dtype=torch.int64)).total
    assert per_call > 0 and one.total == fixed + per_call
    assert three == fixed + 3 * per_call   # gathers grow with the calls, whole-tensor reads do not
    params = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
              for t in [*model.parameters(), *model.buffers()] if t.numel()}
    assert fixed < sum(params.values())


@pytest.mark.triton_interpret
def test_kernels_gathering_rows_count_the_rows_the_references_gather():
    """The talker's code embedding (ops/codebook_sum.py) and MoG latent draw (ops/mog_latent.py) gather rows
    of their tables inside the kernel; the counter must count those rows, as it counts the references'
    embedding / index gathers, not the whole table (counting proj_mus and low_mat as read
    whole adds 0.23 GiB per step at full size, the floor too high). The same
    MoG passes through both paths count the same bytes for each table."""
    from ops import torch_references
    from tests.test_talker import draws, make_model

    model = make_model()
    model.build_tables()
    model.stack_projections()
    b = 3
    h = torch.randn(2 * b, model.cfg.backbone.hidden_size, generator=torch.Generator().manual_seed(1))
    uniform, normal = draws(b, model, 2)
    tables = ("rvq_table", "mog_head.proj_mus.weight", "mog_head.low_mat")
    counted = []
    for kernels in (True, False):
        with contextlib.ExitStack() as stack:
            if not kernels:
                stack.enter_context(torch_references())
            with torch.no_grad(), CountWeightReads(model) as counter:
                model.generate_step(h, uniform, normal)
        counted.append({name: counter.reads.by_tensor().get(name) for name in tables})
    kernels, references = counted
    assert kernels == references, (kernels, references)
    mog = model.mog_head
    block = mog.low_rank * mog.proj_mus.weight.shape[1] * mog.proj_mus.weight.element_size()
    assert kernels["mog_head.proj_mus.weight"] == model.num_passes * b * block < mog.proj_mus.weight.numel() * 4
    q, latent = model.cfg.num_quantizers, model.cfg.latent_size
    assert kernels["rvq_table"] == model.num_passes * b * q * latent * 4


def test_the_floor_counts_fp8_weights_at_one_byte(tiny):
    """With the LLM's and the talker's projections in e4m3 (`fp8_weight_only`), a step reads each at one byte
    an element plus its fp32 row scales, stacks included: the bf16 model's reads less, per such weight, its
    elements (2 bytes -> 1) and plus 4 bytes per row."""
    from eval.models import with_dtypes
    from nemo_duplex.models.config import DtypeConfig
    from nemo_duplex.models.fp8_weights import Fp8Linear

    model = tiny[0]
    slots = torch.arange(2, dtype=torch.int64)
    bf16 = with_dtypes(model, DtypeConfig(llm="bf16", talker="bf16"))
    fp8 = with_dtypes(model, DtypeConfig(llm="bf16", talker="bf16", llm_weights="fp8_weight_only",
                                         talker_weights="fp8_weight_only"))
    totals = [step_weight_reads(m, _state(m), special_ids(m, "cpu"), slots).total for m in (bf16, fp8)]
    projections = [m for m in fp8.modules() if isinstance(m, Fp8Linear)]
    assert len(projections) > 7 * len(fp8.talker.backbone.layers)
    assert totals[0] - totals[1] == sum(m.weight.numel() - 4 * m.weight_scale.numel() for m in projections) > 0
