"""Graphs on vs off: the captured frame step computes what the eager one does.

On the CPU there are no CUDA graphs; "graphs on" is the torch.compile'd step (fullgraph, as on the GPU),
built twice: with the aot_eager compiler, which traces exactly the graph the GPU build captures but runs it
with eager kernels, and with Inductor (its C++ build of the tiny step, ~2 minutes on a 2-core machine),
which compiles that graph. Only the second found the torch.add-with-alpha miscompile (pytorch/pytorch#167313,
~0.5 relative off eager; ops/layernorm.py). The batch is
padded to its bucket with sink rows, as when serving. Teacher-forced: before every frame both paths
start from the same state, and the run continues from the eager path's state, so one near-tie cannot
cascade. Criteria: every stage's output within 1e-4 relative (fp32); a token or code may differ only
where the eager step's top-1/top-2 margin is below 1e-3, and the test reports how many did. One file past 500
lines on purpose: every capture back end against the same eager step and its fixtures.
"""
import copy
import dataclasses
from functools import partial

import pytest
import torch

from graphs.regions import regions_bypassed
from nemo_duplex.models.config import SamplingParams
from nemo_duplex.models.encoder import EncoderStreamState
from nemo_duplex.serving.frame_step import admit, frame_step, special_ids
from nemo_duplex.serving.pages import whole_call_state
from nemo_duplex.serving.runner import HOST_FIELDS, build_runner, engine_compile_cache
from nemo_duplex.serving.state import allocate_call_state, state_tensors
from nemo_duplex.settings import EngineConfig

FRAMES = 200


def _snapshot(st):
    return {k: v.clone() for k, v in state_tensors(st)}


def _restore(st, snap):
    for k, v in state_tensors(st):
        v.copy_(snap[k])


# the KV pools paged as the engine has them, in pages of 16 positions (small: a call crosses many)
PAGE_LEN = 16


def _admitted_state(model, n_calls: int, max_frames: int = 8, device=torch.device("cpu")):
    """Paged pools for n_calls calls, every slot admitted (no prompt, seed = slot)."""
    st = whole_call_state(model, n_calls, max_frames, device, 0, PAGE_LEN)
    for s in range(n_calls):
        admit(model, st, s, None, s, SamplingParams())
    return st


def _assert_real_slots_equal(tensors, expected, n_calls: int, device) -> None:
    """Every state tensor's real slots (0..n_calls-1 along each dimension of n_calls + 1 rows, the sink being
    the last) equal to `expected` (name -> tensor); the sink's rows are not compared."""
    real, compared = torch.arange(n_calls, device=device), 0
    for name, v in tensors:
        for d in [d for d, size in enumerate(v.shape) if size == n_calls + 1]:  # the slot dimension
            assert torch.equal(v.index_select(d, real), expected[name].index_select(d, real)), name
            compared += 1
    assert compared >= 10


def _full_size_bf16(dev):
    """The full-size model, random weights (seed 0), encoder / LLM / talker in bf16, ready to serve."""
    from nemo_duplex.checkpoint.random_weights import random_model
    from nemo_duplex.models.config import ModelConfig

    cfg = ModelConfig()
    cfg = dataclasses.replace(cfg, dtype=dataclasses.replace(cfg.dtype, encoder="bf16", llm="bf16", talker="bf16"))
    model, _, _ = random_model(cfg, dev, seed=0)
    return model.cast_for_inference().eval()


# full-size bf16 comparisons of a compiled step with the eager one (test_graphs_match_eager_full_size_bf16)
LOGIT_ULPS = 4          # a row's top two text logits off eager's by at most this many bf16 ulps of its top-1; a
                        # token may differ where eager's top-1 / top-2 margin is at most twice that (a near-tie)
CODE_FLIP_RATE = 0.02   # the share of rows (text agreeing) whose codes may differ
ENCODER_VS_FP32 = 1.5   # the encoder frame's distance from fp32's, against the eager bf16 step's


def _fp32_twin(state: EncoderStreamState) -> EncoderStreamState:
    """A copy of the encoder's streaming state with its caches in fp32, for the fp32 encoder's step."""
    def copy_of(t: torch.Tensor) -> torch.Tensor:
        return t.clone().float() if t.is_floating_point() else t.clone()
    return EncoderStreamState(**{f.name: copy_of(getattr(state, f.name)) for f in dataclasses.fields(state)})


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().float().clamp_min(1e-30))) - 7)


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _teacher_forced(st, eager_step, graph_step, chunks, check_int_state: bool):
    """Both paths from the same state at every frame, the run continuing from the eager path's state, so
    one near-tie cannot cascade. eager_step / graph_step(chunk) -> the StepOutput of the real rows. Asserts
    that a token or code differs only where eager's top-1/top-2 margin is below 1e-3 (and, with
    check_int_state, that every integer pool but the token-valued ones is equal); returns the worst
    relative error of each stage and of the float pools, and how many rows differed at a near-tie."""
    worst, flips = {}, 0
    for t, chunk in enumerate(chunks):
        before = _snapshot(st)
        out_e = eager_step(chunk)
        after_e = _snapshot(st)
        _restore(st, before)
        out_g = graph_step(chunk)
        after_g = _snapshot(st)
        for name in ("enc", "top2", "pcm"):
            worst[name] = max(worst.get(name, 0.0), _rel(getattr(out_g, name), getattr(out_e, name)))
        for k, v in after_e.items():                      # every pool the step wrote
            if v.is_floating_point():
                worst["state"] = max(worst.get("state", 0.0), _rel(after_g[k], v))
            elif check_int_state and not k.startswith(("prev_", "seen")):  # token-valued: may follow a near-tie
                assert torch.equal(after_g[k], v), k
        margin = (out_e.top2[:, 0] - out_e.top2[:, 1]).abs()
        differs = (out_g.text != out_e.text) | (out_g.codes != out_e.codes).any(-1) | (out_g.func != out_e.func)
        assert (margin[differs] < 1e-3).all(), f"frame {t}: tokens differ at margin {margin[differs].tolist()}"
        flips += int(differs.sum())
        _restore(st, after_e)
    return worst, flips


@torch.no_grad()
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_graphs_match_eager_teacher_forced(tiny, slim, example_clip, compiler):
    """Both compilers over 80 frames of 2 calls (one with a prompt): past the encoder's 70-frame left
    context and the talker's 48-position window. aot_eager traces the tiny model's whole step; Inductor
    compiles the slim one's (a layer of each kind: more layers of a kind add nothing to check) as the server's
    default back end builds it, with a dynamic batch dimension. The KV pools are paged, as the engine has them."""
    model, tok = slim if compiler == "inductor" else tiny[:2]
    st = whole_call_state(model, 2, FRAMES + 4, torch.device("cpu"), 16, PAGE_LEN)
    admit(model, st, 0, None, 3, SamplingParams())
    admit(model, st, 1, model.prompt_ids(tok, "Be brief."), 4, SamplingParams())
    specials = special_ids(model, torch.device("cpu"))
    torch._dynamo.reset()
    graphs = build_runner(model, st, specials, [4], graphs=True, compiler=compiler, backend="cudagraph",
                          dynamic_batch="auto")
    assert graphs.dynamic_batch
    slots = torch.tensor([0, 1])
    forced = torch.tensor([-1, -1])

    def eager(slots, chunk, forced):  # the same padded batch (2 sink rows), uncompiled
        s, a, f, *_ = graphs._padded_inputs(4, slots, chunk, forced)
        out = frame_step(model, st, s, a, f, specials)
        return type(out)(**{k: v[:2] for k, v in out.__dict__.items()})
    n = 1280
    audio = torch.cat([example_clip, example_clip.flip(0), example_clip])  # 222 frames
    frames = 80
    chunks = (torch.stack([audio[t * n: (t + 1) * n], audio[(t + 7) * n: (t + 8) * n]]) for t in range(frames))
    worst, flips = _teacher_forced(st, lambda chunk: eager(slots, chunk, forced),
                                   lambda chunk: graphs(slots, chunk, forced), chunks, check_int_state=True)
    print(f"graphs vs eager over {frames} frames: worst relative error {worst}; {flips} near-tie flips")
    assert all(v <= 1e-4 for v in worst.values()), worst


@torch.no_grad()
def test_compiled_step_with_fp8_weights_matches_eager(slim, example_clip):
    """The whole step traced in one graph (aot_eager, fullgraph) with the LLM's and the talker's projections in
    e4m3 (`fp8_weight_only`, stacks included), the parts in bf16: no graph break, and over 12 frames of 2 calls
    the same stages and state as the eager step (worst relative error <= 1e-4; tokens may differ only at a
    near-tie)."""
    from eval.models import with_dtypes
    from nemo_duplex.models.config import DtypeConfig
    from nemo_duplex.models.fp8_weights import Fp8Linear

    model = with_dtypes(slim[0], DtypeConfig(encoder="bf16", llm="bf16", talker="bf16",
                                             llm_weights="fp8_weight_only", talker_weights="fp8_weight_only"))
    assert any(isinstance(m, Fp8Linear) for m in model.talker.modules())
    st = whole_call_state(model, 2, 16, torch.device("cpu"), 16, PAGE_LEN)
    admit(model, st, 0, None, 3, SamplingParams())
    admit(model, st, 1, None, 4, SamplingParams())
    specials = special_ids(model, torch.device("cpu"))
    torch._dynamo.reset()
    graphs = build_runner(model, st, specials, [4], graphs=True, compiler="aot_eager")
    slots, forced = torch.tensor([0, 1]), torch.tensor([-1, -1])

    def eager(chunk):
        s, a, f, *_ = graphs._padded_inputs(4, slots, chunk, forced)
        out = frame_step(model, st, s, a, f, specials)
        return type(out)(**{k: v[:2] for k, v in out.__dict__.items()})
    n = 1280
    chunks = (torch.stack([example_clip[t * n: (t + 1) * n], example_clip[(t + 7) * n: (t + 8) * n]])
              for t in range(12))
    worst, _ = _teacher_forced(st, eager, lambda chunk: graphs(slots, chunk, forced), chunks, check_int_state=True)
    assert all(v <= 1e-4 for v in worst.values()), worst


@torch.no_grad()
@pytest.mark.parametrize("backend", ["reduce-overhead", "cudagraph"])
def test_compiled_step_copies_nothing_in(slim, backend):
    """The whole-step compiled back ends see every input as a static one (mark_static_inputs): the state
    pools, and the step's own rows (slots, audio, forced), which capture() gives it in the bucket's staged
    buffers, written in place before each call (the weights are graph attributes, lifted as parameters).
    So cudagraph trees copy nothing in at a replay. Before the mark, every pool was an input to copy, and
    reduce-overhead, seeing the step write them, would record no CUDA graph; before the staged buffers, the
    rows were. Read off the example inputs torch.compile hands its backend. The slim model has every kind
    of pool the tiny one has, in a step that traces in a fraction of the time."""
    model, _ = slim
    st = _admitted_state(model, 2)
    specials = special_ids(model, torch.device("cpu"))
    inputs = []

    def backend_seeing_inputs(gm, example_inputs):
        inputs.extend(x for x in example_inputs if isinstance(x, torch.Tensor))
        return gm
    torch._dynamo.reset()
    runner = build_runner(model, st, specials, [4], graphs=True, backend=backend, compiler=backend_seeing_inputs)
    s, a, f, *_ = runner._padded_inputs(4, torch.tensor([0, 1]), torch.zeros(2, 1280), torch.tensor([-1, -1]))
    runner.capture()         # what the engine runs at start-up: the build of each bucket, with its inputs
    copied = [x for x in inputs if not isinstance(x, torch.nn.Parameter)
              and getattr(x, "_dynamo_static_input_type", None) is None]
    pools = {id(t): name for name, t in state_tensors(st)}
    among = {pools[id(x)] for x in inputs if id(x) in pools}
    assert {"llm.k", "llm.v", "llm.ssm", "talker.k", "talker.v", "encoder.keys", "codec.ola_tail"} <= among, among
    assert any(tuple(x.shape) == (4, 1280) for x in inputs)   # the staged audio rows
    assert copied == [], [tuple(x.shape) for x in copied]


def _recorded_graph_inputs_copied(device_index: int) -> list[int]:
    """For every CUDA graph cudagraph trees recorded on the device: how many of its inputs it copies in
    at each replay (those it does not take as static)."""
    from torch._inductor.cudagraph_trees import get_manager

    manager = get_manager(device_index, create_if_none_exists=False)
    nodes, copied = [n for roots in (manager.roots.values() if manager else []) for n in roots], []
    while nodes:
        node = nodes.pop()
        copied.append(len(node.non_static_input_idx))
        nodes.extend(child for children in node.children.values() for child in children)
    return copied


@torch.no_grad()
@pytest.mark.gpu
@pytest.mark.parametrize("static_pools", [True, False])
def test_reduce_overhead_records_a_graph_and_matches_eager(tiny, static_pools, monkeypatch):
    """engine.graph_backend=reduce-overhead on CUDA (tiny model, fp32, one bucket of 4 for 2 calls). With
    the pools and the staged rows marked static (mark_static_inputs): cudagraph trees record one graph that
    copies nothing in, and the replayed step matches the eager one teacher-forced over 50 frames: every
    stage within 1e-4 relative, a token or code differing only where eager's margin is below 1e-3.
    Unmarked (static_pools=False): torch.compile records no CUDA graph,
    and capture() says so. Inductor's caches are off: a build loaded from the cache of the other variant's
    build keeps that build's static inputs."""
    import copy

    from graphs import capture

    if not static_pools:
        monkeypatch.setattr(capture, "mark_static_inputs", lambda *args: None)
    dev = torch.device("cuda")
    model = copy.deepcopy(tiny[0]).cuda()
    st = _admitted_state(model, 2, 60, dev)
    specials = special_ids(model, dev)
    torch._dynamo.reset()
    runner = build_runner(model, st, specials, [4], graphs=True, backend="reduce-overhead")
    s, a, f, *_ = runner._padded_inputs(4, torch.tensor([0, 1]), torch.zeros(2, 1280), torch.tensor([-1, -1]))
    skips = capture.cudagraph_skips()
    with torch._inductor.config.patch(force_disable_caches=True):
        if not static_pools:
            with pytest.raises(RuntimeError, match="recorded no CUDA graph for bucket 4"):
                runner.capture()
            return
        runner.capture()
    copied = _recorded_graph_inputs_copied(dev.index or 0)
    print(f"graphs recorded, inputs copied in per replay {copied}; cudagraph skips {capture.cudagraph_skips() - skips}")
    assert copied == [0], copied
    slots, forced = torch.tensor([0, 1]), torch.tensor([-1, -1])

    def eager(chunk):   # the same padded batch (2 sink rows), uncompiled; its real rows
        out = frame_step(model, st, *runner._padded_inputs(4, slots, chunk, forced)[:3], specials)
        return type(out)(**{k: v[:2] for k, v in out.__dict__.items()})
    g = torch.Generator().manual_seed(1)
    chunks = (torch.randn(2, 1280, generator=g) * 0.1 for _ in range(50))
    worst, flips = _teacher_forced(st, eager, lambda chunk: runner(slots, chunk, forced), chunks,
                                   check_int_state=False)
    assert capture.cudagraph_skips() == skips
    print(f"reduce-overhead vs eager over 50 frames: worst relative error {worst}; {flips} near-tie flips")
    assert all(v <= 1e-4 for v in worst.values()), worst


@torch.no_grad()
@pytest.mark.gpu
@pytest.mark.parametrize("backend", [
    pytest.param("cudagraph", id="compiled"),   # the default; ~3 min to build: `gpu_check.sh tests-compiled`
    "cudagraph-eager",
    pytest.param("cudagraph-regions", marks=pytest.mark.xfail(
        reason="H200: with the compiled regions the talker's codes differed from the plain step at "
               "frame 0 for 5 of 8 calls (the text comes before any region; its margins there were 0.47-0.63); "
               "cause not isolated (graphs/regions.py). Why cudagraph-regions is not the serving default."))])
def test_graphs_match_eager_full_size_bf16(backend, serving_blas):
    """The GPU criterion: full size, bf16, 200 teacher-forced frames, 8 calls padded into a bucket of 16; the
    serving default (Inductor's whole step with a dynamic batch, recorded by hand), the hand capture, and the
    hand capture with the Inductor-compiled regions (graphs/regions.py). Stated bf16 tolerances:
    - the hand capture runs the eager step's own kernels: every output equal, no token or code differs;
    - a compiled step's fusions round elsewhere: the text logits' top two and the PCM of the rows whose tokens
      agree within 2e-2 relative of eager's; each row's top two text logits within LOGIT_ULPS bf16 ulps of
      eager's, and a text token may differ only at a near-tie, eager's top-1 / top-2 margin at most twice that;
      the talker's codes (the RVQ's nearest codeword of a latent that rounds elsewhere too, which has no margin
      in the step's outputs) may differ in at most CODE_FLIP_RATE of the rows whose text agrees; the encoder
      frame, 17 bf16 layers that round wherever a fusion puts it, no further from the fp32 encoder's frame
      (from the same state) than ENCODER_VS_FP32 times the eager bf16 step's worst distance from it.
    The test reports how many tokens and codes differed and each path's distance from fp32."""
    dev = torch.device("cuda")
    model = _full_size_bf16(dev)
    n_calls = 8
    st = _admitted_state(model, n_calls, FRAMES + 4, dev)
    specials = special_ids(model, dev)
    graphs = build_runner(model, st, specials, [16], graphs=True, backend=backend, dynamic_batch="auto")
    graphs.capture()
    slots = torch.arange(n_calls)
    forced = torch.full((n_calls,), -1)
    perception_fp32 = copy.deepcopy(model.perception).float()
    g = torch.Generator().manual_seed(0)
    worst, margins, deviations, code_flips = {}, [], [], 0
    for t in range(FRAMES):
        chunk = torch.randn(n_calls, 1280, generator=g) * 0.1
        enc_fp32 = perception_fp32.stream_step(chunk.to(dev), _fp32_twin(st.encoder), slots.to(dev))
        before = _snapshot(st)
        s, a, f, *_ = graphs._padded_inputs(16, slots, chunk, forced)
        with regions_bypassed(model):  # the plain eager step, not the compiled regions uncaptured
            out_e = frame_step(model, st, s, a, f, specials)
        after_e = _snapshot(st)
        _restore(st, before)
        out_g = graphs(slots, chunk, forced)
        text_flip = (out_g.text != out_e.text[:n_calls]).to(dev)
        code_flip = (out_g.codes != out_e.codes[:n_calls]).any(-1).to(dev) & ~text_flip  # else another text token
        top1, top2 = out_e.top2[:n_calls, 0], out_e.top2[:n_calls, 1]
        ulp = _bf16_ulp(top1)
        margins.append(((top1 - top2).abs() / ulp)[text_flip])
        deviations.append(((out_g.top2.to(dev) - out_e.top2[:n_calls]).abs().amax(-1) / ulp)[~text_flip])
        agree = ~(text_flip | code_flip)
        for name, rows in (("enc", slice(None)), ("top2", slice(None)), ("pcm", agree)):
            worst[name] = max(worst.get(name, 0.0), _rel(getattr(out_g, name).to(dev)[rows],
                                                          getattr(out_e, name)[:n_calls][rows]))
        for name, enc in (("eager enc vs fp32", out_e.enc[:n_calls]), ("enc vs fp32", out_g.enc.to(dev))):
            worst[name] = max(worst.get(name, 0.0), _rel(enc.float(), enc_fp32))
        code_flips += int(code_flip.sum())
        _restore(st, after_e)
    margins, deviations = torch.cat(margins).cpu(), torch.cat(deviations).cpu()
    print(f"{backend}: worst relative error {worst}; the text differed in {margins.numel()} of {FRAMES * n_calls} rows "
          f"(eager's top-1 / top-2 margins there, bf16 ulps: {margins.tolist()}), the codes alone in {code_flips}; "
          f"the top two logits of the other rows off eager's by p50 / p99 / max "
          f"{deviations.quantile(0.5):.2f} / {deviations.quantile(0.99):.2f} / {deviations.max():.2f} ulps")
    if backend == "cudagraph-eager":
        assert margins.numel() == 0 and not code_flips and all(worst[k] == 0.0 for k in ("enc", "top2", "pcm")), worst
    assert deviations.max() <= LOGIT_ULPS, deviations.max()
    assert (margins <= 2 * LOGIT_ULPS).all(), margins
    assert worst["enc vs fp32"] <= ENCODER_VS_FP32 * worst["eager enc vs fp32"], worst
    assert all(worst[name] <= 2e-2 for name in ("top2", "pcm")), worst
    assert code_flips <= CODE_FLIP_RATE * FRAMES * n_calls, code_flips


@torch.no_grad()
@pytest.mark.gpu
def test_side_stream_step_is_the_one_stream_step_bit_for_bit(serving_blas):
    """frame_step's `branch` (the RNN-T and the text's bookkeeping on a second stream: a parallel path of
    each captured graph) changes only the kernels' order: full size, bf16, 8 calls in a bucket of 16, 30
    frames, captured: every output and, at the end, every real slot's state identical to the one-stream
    step's on a twin state; and the same for 5 eager frames (their real rows: the 8 padding rows all
    write the sink, in no set order, so the sink's own state and outputs are not compared)."""
    dev = torch.device("cuda")
    model = _full_size_bf16(dev)
    assert model.has_rnnt
    n_calls, frames = 8, 30
    states = [_admitted_state(model, n_calls, frames + 8, dev) for _ in range(2)]
    specials = special_ids(model, dev)
    one = build_runner(model, states[0], specials, [16], graphs=True, backend="cudagraph-eager", side_stream=False)
    two = build_runner(model, states[1], specials, [16], graphs=True, backend="cudagraph-eager", side_stream=True)
    assert one.step.side_stream is None and two.step.side_stream is not None
    one.capture()
    two.capture()
    slots = torch.arange(n_calls)
    forced = torch.full((n_calls,), -1)
    g = torch.Generator().manual_seed(5)
    emitted = 0
    for t in range(frames + 5):
        chunk = torch.randn(n_calls, 1280, generator=g) * 0.1
        if t < frames:
            outs = [one(slots, chunk, forced), two(slots, chunk, forced)]
        else:  # eager, the padded batch as the graphs see it
            s, a, f, *_ = one._padded_inputs(16, slots, chunk, forced)
            outs = [frame_step(model, st, s, a, f, specials, side_stream=side)
                    for st, side in zip(states, (None, two.step.side_stream))]
        for name in ("text", "func", "top2", "codes", "pcm", "user", "enc"):
            assert torch.equal(getattr(outs[0], name)[:n_calls], getattr(outs[1], name)[:n_calls]), (t, name)
        emitted += int((outs[0].user[:n_calls] >= 0).sum())
    assert states[0].sink == n_calls
    _assert_real_slots_equal(state_tensors(states[0]), dict(state_tensors(states[1])), n_calls, dev)
    print(f"side stream: identical over {frames} captured + 5 eager frames; {emitted} RNN-T tokens emitted")


def _alone_and_shared(model, buckets, n_calls: int, frames: int, dev, backend: str = "cudagraph-eager") -> list[int]:
    """Slot 0 stepped alone on one state and beside n_calls - 1 other calls on a twin state, both through
    captured graphs of `buckets` (`backend`), free-running. -> the frames at which slot 0's outputs differ."""
    specials = special_ids(model, dev)
    runners = []
    for _ in range(2):
        st = allocate_call_state(model, n_calls, frames + 8, dev, max_prompt_tokens=0)
        for s in range(n_calls):  # slot 0 samples (the sort over the vocabulary), every third call is greedy
            admit(model, st, s, None, 100 + s, SamplingParams() if s % 3 == 1 else SamplingParams(0.8, 0.9))
        runners.append(build_runner(model, st, specials, buckets, graphs=True, backend=backend, dynamic_batch="auto"))
        runners[-1].capture()
    slots, forced = torch.arange(n_calls), torch.full((n_calls,), -1)
    g = torch.Generator().manual_seed(7)
    differ = []
    for t in range(frames):
        chunk = torch.randn(n_calls, 1280, generator=g) * 0.1
        alone = runners[0](slots[:1], chunk[:1], forced[:1])
        shared = runners[1](slots, chunk, forced)
        if not all(torch.equal(getattr(alone, name)[0], getattr(shared, name)[0])
                   for name in ("text", "func", "top2", "codes", "pcm", "user", "enc")):
            differ.append(t)
    return differ


@torch.no_grad()
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudagraph-eager", pytest.param("cudagraph", id="compiled")])
def test_one_capture_bucket_makes_a_call_batch_invariant_full_size_bf16(serving_blas, backend):
    """Determinism on the GPU in bf16 (engine.batch_invariant; docs/design.md). With the default buckets a call's
    bits depend on how many calls share its step (cuBLASLt's split-K and cuDNN's convolution pick kernels by
    row count). With ONE capture bucket every step runs the same rows, so every kernel is the same whatever
    shares the batch: a call's outputs (text, function token, margins, codes, PCM, RNN-T tokens, encoder
    frame) are identical bit for bit alone and beside 31 others, full size, bf16, 40 frames free-running
    (one differing bit at a near-tie would part the runs for good; with random weights most frames are
    near-ties). The hand capture and the compiled default (Inductor's own kernels in place of the
    hand-written pointwise ones); the hand capture's result with two buckets is printed beside it."""
    dev = torch.device("cuda")
    model = _full_size_bf16(dev)
    n_calls, frames = 32, 40
    one_bucket = _alone_and_shared(model, [n_calls], n_calls, frames, dev, backend)
    if backend == "cudagraph-eager":
        default = _alone_and_shared(model, [1, n_calls], n_calls, frames, dev, backend)
        print(f"slot 0 alone vs beside {n_calls - 1} calls, {frames} frames: buckets [1, {n_calls}]: "
              f"{len(default)} frames differ (first {default[:3]})")
    print(f"{backend}: one bucket [{n_calls}]: {len(one_bucket)} frames differ")
    assert one_bucket == [], one_bucket


@torch.no_grad()
@pytest.mark.gpu
def test_buckets_sharing_one_graph_pool_match_eager(tiny):
    """Every bucket's graph is captured into one memory pool (graphs/capture.py), so a replay may
    overwrite another bucket's intermediates and outputs. Batches of 1..5 calls in a random order over
    buckets [1, 2, 4, 8] (each replay's neighbours are other buckets): tokens and codes identical to
    eager twins, PCM within 1e-5 (fp32, the same kernels captured or not). The engine's path
    (`step_to_host`: inputs and outputs through one pinned buffer each, groups above the largest
    bucket, the greedy-only variants for half the batches) gives the same numbers on a third twin."""
    import copy

    model = copy.deepcopy(tiny[0]).cuda()
    dev = torch.device("cuda")
    specials = special_ids(model, dev)
    # identical triplets: graphs through __call__, graphs through step_to_host, eager
    states = [_admitted_state(model, 5, 40, dev) for _ in range(3)]
    runner = build_runner(model, states[0], specials, [1, 2, 4, 8], graphs=True, backend="cudagraph-eager")
    runner.capture()
    staged = build_runner(model, states[1], specials, [1, 2, 4], graphs=True, backend="cudagraph-eager",
                        greedy_graphs=True)
    staged.capture()   # largest bucket 4: a batch of 5 runs as two staged groups (4 + 1)
    g = torch.Generator().manual_seed(3)
    for n in [3, 1, 5, 2, 4, 1, 3, 5, 2, 2, 4, 1]:
        slots = torch.randperm(5, generator=g)[:n]
        audio = torch.randn(n, 1280, generator=g) * 0.1
        forced = torch.full((n,), -1)
        forced[0] = 7 if n == 3 else -1   # a forced function token goes through the staged inputs too
        out_g = runner(slots, audio, forced)
        # every call is greedy: odd batches through the greedy-only graphs, even ones the general graphs
        host = staged.step_to_host(slots.numpy(), audio.numpy(), forced.numpy(), sampling=n % 2 == 0)
        out_e = frame_step(model, states[2], slots.to(dev), audio.to(dev), forced.to(dev), specials)
        assert torch.equal(out_g.text, out_e.text) and torch.equal(out_g.codes, out_e.codes), n
        torch.testing.assert_close(out_g.pcm, out_e.pcm, rtol=1e-5, atol=1e-5)
        assert host.padded_rows == {1: 1, 2: 2, 3: 4, 4: 4, 5: 5}[n]
        for k in HOST_FIELDS:
            assert host.outputs[k].shape == tuple(getattr(out_e, k).shape), k
            torch.testing.assert_close(torch.from_numpy(host.outputs[k]), getattr(out_e, k).cpu(), rtol=1e-5,
                                       atol=1e-5, msg=lambda m, k=k: f"{k}, batch {n}: {m}")
    assert len(runner._cuda_graphs) == 4 and len(staged._staging) == 6   # 3 buckets x 2 variants


@torch.no_grad()
@pytest.mark.gpu
def test_capture_replays_each_graph_once_on_the_sink_only():
    """capture() replays every graph once after recording it (the first launch uploads the graph, so the
    first calls in a bucket do not pay for it): those replays run on sink rows, so every real slot's state
    is bit-identical before and after capture, and each (bucket, variant) has its replay times."""
    from nemo_duplex.checkpoint.random_weights import random_model
    from nemo_duplex.models.config import tiny_config

    dev = torch.device("cuda")
    model, _, _ = random_model(tiny_config(), dev, seed=0)
    model.cast_for_inference().eval()
    n_calls = 10  # 11 slots with the sink: no other pool dimension has that size
    st = _admitted_state(model, n_calls, device=dev)
    assert st.sink == n_calls
    before = _snapshot(st)
    runner = build_runner(model, st, special_ids(model, dev), [2, 4], graphs=True, backend="cudagraph-eager",
                        greedy_graphs=True)
    runner.capture()
    assert set(runner.replay_ms) == {(2, True), (2, False), (4, True), (4, False)}
    assert all(first > 0 and second > 0 for first, second in runner.replay_ms.values())
    _assert_real_slots_equal(state_tensors(st), before, n_calls, dev)


def test_padding_rows_never_advance_the_sink(tiny):
    """Every padded step points its padding rows at the sink. Its positions must stay put: after more
    padded steps than the pools hold frames, an advancing sink would write past the KV pools (on the GPU
    a device-side assert that ended every call of a load test)."""
    model, *_ = tiny
    st = allocate_call_state(model, 1, 6, torch.device("cpu"), max_prompt_tokens=0)
    admit(model, st, 0, None, 0, SamplingParams())
    specials = special_ids(model, torch.device("cpu"))
    sink = st.sink
    before = (st.llm_len[sink].item(), st.talker_pos[sink].item(), st.frame[sink].item())
    g = torch.Generator().manual_seed(0)
    for t in range(20):  # 5 frames of the real call padded by two sink rows, then sink rows alone
        slots = torch.tensor([0, sink, sink]) if t < 5 else torch.tensor([sink, sink])
        audio = torch.randn(slots.shape[0], 1280, generator=g) * 0.1
        frame_step(model, st, slots, audio, torch.full((slots.shape[0],), -1), specials)
    assert (st.llm_len[sink].item(), st.talker_pos[sink].item(), st.frame[sink].item()) == before
    assert st.llm_len[0].item() == 5 and st.frame[0].item() == 5



@torch.no_grad()
def test_batch_above_the_largest_bucket_runs_in_groups(tiny):
    """5 calls through buckets [2]: groups of 2, 2 and 1 (the last padded with a sink row), each its
    bucket's step (the hand-capture back end: on the CPU the step as it is; that a compiled step equals the
    eager one is the teacher-forced test's); the outputs equal one eager step over all 5 rows (rows are
    independent)."""
    model, *_ = tiny
    specials = special_ids(model, torch.device("cpu"))
    states = [_admitted_state(model, 5) for _ in range(2)]  # identical twins
    grouped = build_runner(model, states[0], specials, [2], graphs=True, backend="cudagraph-eager")
    slots, forced = torch.arange(5), torch.full((5,), -1)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        audio = torch.randn(5, 1280, generator=g) * 0.1
        out_g = grouped(slots, audio, forced)
        out_e = frame_step(model, states[1], slots, audio, forced, specials)
        assert out_g.text.shape == (5,) and out_g.pcm.shape == out_e.pcm.shape
        assert torch.equal(out_g.text, out_e.text) and torch.equal(out_g.codes, out_e.codes)
        torch.testing.assert_close(out_g.pcm, out_e.pcm, rtol=1e-5, atol=1e-5)
    assert torch.equal(states[0].llm_len, states[1].llm_len)


def test_graphs_auto_means_captured_on_cuda_only(tiny):
    model, *_ = tiny
    st = allocate_call_state(model, 1, 4, torch.device("cpu"), max_prompt_tokens=0)
    specials = special_ids(model, torch.device("cpu"))
    assert build_runner(model, st, specials, [1], graphs="auto").graphs is False
    assert build_runner(model, st, specials, [1], graphs=False).graphs is False


@torch.no_grad()
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_regions_match_eager(tiny, slim, compiler):
    """cudagraph-regions: the talker's MoG passes and the RNN-T loop compiled on their own (fullgraph),
    the rest eager. Over 4 frames of 3 calls in a bucket of 4 (one sink row): tokens and codes identical
    to the plain step; PCM and the logits within 1e-5 (aot_eager runs the same ops: exact; Inductor's
    fused fp32 arithmetic: a few ulp). Inductor compiles the slim model's regions (two turns of each loop)."""
    from graphs.regions import remove_regions

    model = slim[0] if compiler == "inductor" else tiny[0]
    specials = special_ids(model, torch.device("cpu"))
    states = [_admitted_state(model, 3) for _ in range(2)]  # identical twins
    slots, forced = torch.arange(3), torch.full((3,), -1)
    g = torch.Generator().manual_seed(2)
    frames = [torch.randn(3, 1280, generator=g) * 0.1 for _ in range(4)]
    padded_slots = torch.tensor([0, 1, 2, states[1].sink])
    eager = [frame_step(model, states[1], padded_slots, torch.cat([a, torch.zeros(1, 1280)]),
                        torch.full((4,), -1), specials) for a in frames]  # before any region is installed
    try:
        runner = build_runner(model, states[0], specials, [4], graphs=True, backend="cudagraph-regions",
                            compiler=compiler)
        assert [r.name for r in runner.regions] == ["talker.generate_step", "stt_model.rnnt_decoder.decode_frame"]
        for audio, out_e in zip(frames, eager):
            out_r = runner(slots, audio, forced)
            assert torch.equal(out_r.text, out_e.text[:3]) and torch.equal(out_r.codes, out_e.codes[:3])
            assert torch.equal(out_r.user, out_e.user[:3])
            torch.testing.assert_close(out_r.pcm, out_e.pcm[:3], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out_r.top2, out_e.top2[:3], rtol=1e-5, atol=1e-5)
        assert all(r.failed is None for r in runner.regions), [r.failed for r in runner.regions]
        with regions_bypassed(model):  # the plain methods for a reference step, the same regions after
            assert "generate_step" not in model.talker.__dict__
        assert model.talker.__dict__["generate_step"] is runner.regions[0]
    finally:
        remove_regions(model)


def test_padded_rows_per_batch(tiny):
    """What a batch costs in rows (engine stats, /metrics duplex_padded_rows): its bucket, groups of the
    largest bucket above it, itself when eager (unless eager steps are padded too: batch invariance)."""
    model, *_ = tiny
    st = allocate_call_state(model, 1, 4, torch.device("cpu"), max_prompt_tokens=0)
    specials = special_ids(model, torch.device("cpu"))
    runner = build_runner(model, st, specials, [8, 2], graphs=True, compiler="aot_eager")
    assert [runner.padded_rows(n) for n in (1, 2, 3, 8, 9, 17)] == [2, 2, 8, 8, 10, 18]
    assert build_runner(model, st, specials, [8, 2], graphs=False).padded_rows(3) == 3
    assert build_runner(model, st, specials, [8], graphs=False, pad_eager=True).padded_rows(3) == 8


def test_padded_eager_step_runs_the_bucket_and_its_groups(tiny):
    """pad_eager (engine.batch_invariant without graphs): 5 calls through bucket [2] run eagerly as groups
    of 2, 2 and 1 + a sink row, and give the same tokens and codes as one eager step over all 5 rows; the
    sink takes the padding (the real slots advance once per step, the sink never)."""
    model, *_ = tiny
    specials = special_ids(model, torch.device("cpu"))
    states = [_admitted_state(model, 5) for _ in range(2)]
    padded = build_runner(model, states[0], specials, [2], graphs=False, pad_eager=True)
    seen = []
    padded.step = lambda s, a, f, speech, text, sampling: seen.append(s.tolist()) or frame_step(model, states[0], s, a, f, specials)
    slots, forced = torch.arange(5), torch.full((5,), -1)
    audio = torch.randn(5, 1280, generator=torch.Generator().manual_seed(2)) * 0.1
    out_p = padded(slots, audio, forced)
    out_e = frame_step(model, states[1], slots, audio, forced, specials)
    assert seen == [[0, 1], [2, 3], [4, states[0].sink]]
    assert torch.equal(out_p.text, out_e.text) and torch.equal(out_p.codes, out_e.codes)
    assert torch.equal(states[0].llm_len, states[1].llm_len)


def test_buckets_for_max_calls():
    from graphs.capture import buckets_for

    assert buckets_for([1, 2, 4, 8, 16, 32], 8) == [1, 2, 4, 8]
    assert buckets_for([32, 1, 8, 8, 64], 20) == [1, 8, 32]      # the smallest bucket at or above 20
    assert buckets_for([1, 2, 4], 6) == [1, 2, 4, 6]              # none above: max_calls itself
    assert buckets_for([4, 16], 1) == [4]


@torch.no_grad()
def test_greedy_only_step_equals_the_general_step_for_greedy_calls(tiny):
    """frame_step(sampling=False) (what the greedy-only graphs run) against the general step on twin
    states of greedy calls, 6 frames of 3 calls: tokens, codes, PCM and every state tensor identical."""
    model, *_ = tiny
    specials = special_ids(model, torch.device("cpu"))
    states = [_admitted_state(model, 3) for _ in range(2)]
    slots, forced = torch.arange(3), torch.tensor([-1, 5, -1])
    g = torch.Generator().manual_seed(4)
    for _ in range(6):
        audio = torch.randn(3, 1280, generator=g) * 0.1
        general = frame_step(model, states[0], slots, audio, forced, specials)
        greedy = frame_step(model, states[1], slots, audio, forced, specials, sampling=False)
        for name in ("text", "func", "codes", "pcm", "top2", "user"):
            assert torch.equal(getattr(greedy, name), getattr(general, name)), name
    for (name, a), (_, b) in zip(state_tensors(states[0]), state_tensors(states[1])):
        assert torch.equal(a, b), name


def test_greedy_batches_use_only_what_was_captured(tiny):
    """Without greedy_graphs, an all-greedy batch runs the general captured step (no capture while
    serving); with it, capture() prepares both and a greedy batch runs the greedy-only one. The routing is
    the runner's, whatever the back end: the hand-capture back end, which on the CPU runs the step as it is
    (with aot_eager's compiles this test took 76 s of CI)."""
    model, *_ = tiny
    specials = special_ids(model, torch.device("cpu"))
    calls = []

    def counting(runner):
        real = runner._compiled

        def wrapped(s, a, f, speech=None, text=None, sampling=True):
            calls.append(sampling)
            return real(s, a, f, speech, text, sampling)
        runner._compiled = wrapped
        return runner

    slots, audio, forced = torch.arange(2), torch.zeros(2, 1280), torch.full((2,), -1)
    for greedy_graphs, expect in ((False, [True]), (True, [False])):
        st = _admitted_state(model, 2)
        runner = counting(build_runner(model, st, specials, [2], graphs=True, backend="cudagraph-eager",
                                     greedy_graphs=greedy_graphs))
        runner.capture()
        assert calls == [True] * 3 + ([False] * 3 if greedy_graphs else [])   # warm-up calls per variant
        calls.clear()
        runner(slots, audio, forced, sampling=False)
        assert calls == expect
        calls.clear()


@torch.no_grad()
def test_compiled_calls_check_only_the_guards_that_tell_builds_apart(slim, caplog):
    """After capture(), a compiled step (reduce-overhead's path, aot_eager on the CPU) is called with Dynamo
    evaluating only the guards between its builds (StepRunner._run_prepared). Two buckets x two variants
    (greedy graphs), calls mixed across them, through `runner(...)` and through the staged path the engine
    takes (step_to_host: the bucket's staged buffers in, one host buffer out): each call runs with guard
    evaluation skipped, nothing is compiled after capture, and each gives what the eager step over the
    same padded rows gives from the same state: the build of its own bucket and variant (calls of sampling
    rows through the greedy variant give other tokens than through the general one, so a swapped build
    would show). Tolerances: tokens and codes identical, floats within 1e-5 relative (aot_eager runs the
    same aten ops). A call under torch settings the builds were not made under (deterministic algorithms flipped)
    takes every guard instead, with a warning, and gives the same outputs."""
    from torch._dynamo import eval_frame
    from torch._dynamo.utils import counters

    model, _ = slim
    st = _admitted_state(model, 4)
    for s in range(4):
        st.temperature[s], st.greedy[s] = 1.5, False   # sampling rows: the two variants differ on them
    specials = special_ids(model, torch.device("cpu"))
    torch._dynamo.reset()
    runner = build_runner(model, st, specials, [2, 4], graphs=True, backend="reduce-overhead",
                          compiler="aot_eager", greedy_graphs=True)
    skipped = {"capture": [], "serve": []}

    def spy(fn, when):   # records whether guard evaluation is skipped at each call
        def call(*inputs):
            skipped[when].append(eval_frame._stance.skip_guard_eval_unsafe)
            return fn(*inputs)
        return call
    runner._compiled = spy(runner._compiled, "capture")   # what capture() builds through
    runner._built = spy(runner._built, "serve")           # what a prepared call runs (_run_prepared)
    s, a, f, *_ = runner._padded_inputs(4, torch.tensor([0, 1]), torch.zeros(2, 1280), torch.tensor([-1, -1]))
    runner.capture()
    assert skipped["capture"] and not any(skipped["capture"])   # capture's calls build and check everything
    assert skipped["serve"] == [True] * 4   # and then each build is called once as it will serve (4 builds)
    skipped["serve"].clear()
    built = counters["stats"]["unique_graphs"]
    g, differed = torch.Generator().manual_seed(7), 0
    for n, sampling in ((1, True), (3, False), (2, False), (4, True), (1, False), (3, True)):
        slots, forced = torch.arange(n), torch.full((n,), -1)
        audio = torch.randn(n, 1280, generator=g) * 0.1
        before = _snapshot(st)
        padded = runner._padded_inputs(runner.bucket_for(n), slots, audio, forced)
        other = runner._eager(*padded, not sampling)
        _restore(st, before)
        eager = runner._eager(*padded, sampling)
        _restore(st, before)
        out = runner(slots, audio, forced, sampling=sampling)
        _restore(st, before)
        with torch.enable_grad():   # the caller's grad mode is not the build's concern (bench_step has it on)
            host = runner.step_to_host(slots.numpy(), audio.numpy(), forced.numpy(), sampling=sampling)
        differed += int(not torch.equal(eager.text[:n], other.text[:n])
                        or not torch.equal(eager.codes[:n], other.codes[:n]))
        assert host.padded_rows == runner.bucket_for(n)
        for field in dataclasses.fields(out):
            got, want = getattr(out, field.name), getattr(eager, field.name)[:n]
            staged = torch.from_numpy(host.outputs[field.name]) if field.name in runner.host_fields else None
            if got.is_floating_point():
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=field.name)
                if staged is not None:
                    torch.testing.assert_close(staged, want, rtol=1e-5, atol=1e-6, msg=field.name)
            else:
                assert torch.equal(got, want), (n, sampling, field.name)
                assert staged is None or torch.equal(staged, want), (n, sampling, field.name)
    assert runner.staged and skipped["serve"] == [True] * 12
    assert counters["stats"]["unique_graphs"] == built
    assert differed > 0
    # under torch settings the builds were not made under, a call is refused without the guards: it then
    # takes them all, builds what it needs and gives the eager step's outputs, with a warning
    slots, forced, audio = torch.arange(3), torch.full((3,), -1), torch.randn(3, 1280, generator=g) * 0.1
    before = _snapshot(st)
    eager = runner._eager(*runner._padded_inputs(4, slots, audio, forced), True)
    _restore(st, before)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(not was)
    try:
        with caplog.at_level("WARNING"):
            host = runner.step_to_host(slots.numpy(), audio.numpy(), forced.numpy())
    finally:
        torch.use_deterministic_algorithms(was)
    assert "called under torch settings its builds were not made under" in caplog.text
    assert torch.equal(torch.from_numpy(host.outputs["text"]), eager.text[:3])
    assert torch.equal(torch.from_numpy(host.outputs["codes"]), eager.codes[:3])


@torch.no_grad()
def test_dynamic_batch_builds_once_for_the_buckets_above_one(slim, caplog):
    """engine.compile_dynamic_batch (aot_eager on the CPU): buckets 1, 2, 4 and 8 take two builds, one with a
    dynamic batch dimension for 2, 4 and 8 and one for 1 (Dynamo specialises a size of 1), where static
    builds take four; each bucket's staged step gives what the eager step over the same padded rows gives
    (tokens and codes identical, floats within 1e-5 relative), and the calls compile nothing more. The
    setting on a back end that does not compile is named in a warning; the build bucket 1 costs, in a log line."""
    from torch._dynamo.utils import counters

    model, _ = slim
    st = _admitted_state(model, 8)
    specials = special_ids(model, torch.device("cpu"))
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    with caplog.at_level("INFO"):
        runner = build_runner(model, st, specials, [1, 2, 4, 8], graphs=True, backend="reduce-overhead",
                              compiler="aot_eager", dynamic_batch=True)
    assert "bucket 1 is a build of its own" in caplog.text and "runs in bucket 2" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        runner.capture()   # with no step before it: the state's allocation built the streaming tables
    built = counters["stats"]["unique_graphs"] - before
    assert built == 2, built
    # a build with no compile cache says it is one, at every start, and names the fallback
    assert "torch.compile builds the step" in caplog.text and "compile_cache_dir=null" in caplog.text
    assert "engine.graph_backend=cudagraph-eager captures it by hand" in caplog.text
    g = torch.Generator().manual_seed(9)
    for n in (1, 3, 2, 8, 5):
        slots, forced = torch.arange(n), torch.full((n,), -1)
        audio = torch.randn(n, 1280, generator=g) * 0.1
        snapshot = _snapshot(st)
        eager = runner._eager(*runner._padded_inputs(runner.bucket_for(n), slots, audio, forced), True)
        _restore(st, snapshot)
        host = runner.step_to_host(slots.numpy(), audio.numpy(), forced.numpy())
        for name in runner.host_fields:
            got, want = torch.from_numpy(host.outputs[name]), getattr(eager, name)[:n]
            if got.is_floating_point():
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
            else:
                assert torch.equal(got, want), (n, name)
    assert counters["stats"]["unique_graphs"] - before == 2
    with caplog.at_level("WARNING"):
        build_runner(model, st, specials, [1], graphs=True, backend="cudagraph-eager", dynamic_batch=True)
    assert "engine.compile_dynamic_batch=true is unused" in caplog.text


def test_dynamic_batch_auto_is_on_where_the_step_compiles_and_silent_elsewhere(slim, caplog):
    """engine.compile_dynamic_batch "auto" (the default) builds one dynamic step under the compiled back ends
    and is off, with no warning, under the hand capture (the fallback) and on eager steps; true under the hand
    capture warns; any other value is refused, naming the setting."""
    model, _ = slim
    st = _admitted_state(model, 4)
    specials = special_ids(model, torch.device("cpu"))
    make = partial(build_runner, model, st, specials, [2, 4])
    with caplog.at_level("WARNING"):
        assert make(graphs=True, backend="cudagraph", compiler="aot_eager", dynamic_batch="auto").dynamic_batch
        assert make(graphs=True, backend="reduce-overhead", compiler="aot_eager", dynamic_batch="auto").dynamic_batch
        assert not make(graphs=True, backend="cudagraph", compiler="aot_eager", dynamic_batch=False).dynamic_batch
        assert not make(graphs=True, backend="cudagraph-eager", dynamic_batch="auto").dynamic_batch
        assert not make(graphs="auto", backend="cudagraph", dynamic_batch="auto").dynamic_batch   # CPU: eager
    assert "compile_dynamic_batch" not in caplog.text
    with caplog.at_level("WARNING"):
        make(graphs=True, backend="cudagraph-eager", dynamic_batch=True)
    assert "engine.compile_dynamic_batch=true is unused" in caplog.text
    with pytest.raises(ValueError, match="engine.compile_dynamic_batch must be auto, true or false"):
        make(graphs=True, backend="cudagraph", compiler="aot_eager", dynamic_batch="yes")


def test_a_runner_says_what_its_steps_run_as_and_whether_they_compile(slim):
    """StepRunner.kind (the server's start line, serve.prepare_only) is the back end where graphs are on and "eager"
    where they are not (graphs "auto" on the CPU); compiles is whether torch.compile builds any of the step. The
    engine's compile cache, decided before a runner exists, exists exactly where the runner compiles."""
    model, _ = slim
    cpu = torch.device("cpu")
    st = _admitted_state(model, 4)
    make = partial(build_runner, model, st, special_ids(model, cpu), [2, 4])
    for graphs, backend, kind, compiles in [("auto", "cudagraph", "eager", False), (False, "cudagraph", "eager", False),
                                            (True, "cudagraph", "cudagraph", True),
                                            (True, "cudagraph-eager", "cudagraph-eager", False),
                                            (True, "cudagraph-regions", "cudagraph-regions", True),
                                            (True, "reduce-overhead", "reduce-overhead", True)]:
        runner = make(graphs=graphs, backend=backend, compiler="aot_eager")
        assert (runner.kind, runner.compiles) == (kind, compiles), (graphs, backend)
        cache = engine_compile_cache(model, cpu, EngineConfig(graphs=graphs, graph_backend=backend,
                                                              compile_cache_dir="auto"), [2, 4])
        assert (cache is not None) == compiles, (graphs, backend)


def test_a_compiler_failure_at_start_names_the_fallback(slim, monkeypatch):
    """A build torch.compile cannot make (here Dynamo's error, raised in place of the build) ends the start with
    an error naming the setting that serves without the compiler; an error that is not the compiler's passes
    through as it was."""
    model, _ = slim
    st = _admitted_state(model, 4)
    runner = build_runner(model, st, special_ids(model, torch.device("cpu")), [2, 4], graphs=True,
                          backend="cudagraph", compiler="aot_eager", dynamic_batch="auto")

    def failing(*args, **kwargs):
        raise torch._dynamo.exc.TorchDynamoException("no compiler here")
    monkeypatch.setattr(runner, "_compiled", failing)
    with pytest.raises(RuntimeError, match="engine.graph_backend=cudagraph: torch.compile could not build the step "
                                           r"\(TorchDynamoException: no compiler here\); "
                                           "engine.graph_backend=cudagraph-eager captures") as raised:
        runner.capture()
    assert isinstance(raised.value.__cause__, torch._dynamo.exc.TorchDynamoException)

    def broken(*args, **kwargs):
        raise ValueError("not the compiler")
    monkeypatch.setattr(runner, "_compiled", broken)
    with pytest.raises(ValueError, match="not the compiler"):
        runner.capture()


def test_every_served_cuda_graph_is_recorded_on_a_stream_it_names():
    """torch gives cuBLAS a workspace per (thread, stream) and a graph keeps the one it was recorded with:
    graphs recorded on torch.cuda.graph's default capture stream share it, and two of them replayed at once
    (the admission's beside a step's) corrupt each other's split-K sums or never finish (graphs/shapes.py).
    So every capture in the served code names the stream it records on."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    captures = []
    for folder in ("graphs", "nemo_duplex", "ops"):
        for path in (repo / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if "torch.cuda.graph(" in line:
                    captures.append((f"{path.relative_to(repo)}:{number}", line))
    assert captures   # graphs/shapes.py's record_graph, which the step's buckets and ShapeGraphs record with
    unnamed = [where for where, line in captures if "stream=" not in line]
    assert not unnamed, f"CUDA graphs recorded on the default capture stream: {unnamed}"
