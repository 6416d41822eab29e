"""A call's admission in pieces and as CUDA graphs (serving/admission_graphs.py, frame_step.prompt_pieces)."""
import copy

import pytest
import torch

from graphs.shapes import ShapeGraphs
from nemo_duplex.models.config import SamplingParams
from nemo_duplex.serving.admission_graphs import AdmissionGraphs, piece_sizes
from nemo_duplex.serving.engine import build_engine
from nemo_duplex.serving.frame_step import admission, prompt_pieces
from nemo_duplex.serving.state import allocate_call_state, state_tensors
from nemo_duplex.settings import EngineConfig


@pytest.mark.parametrize("chunk", [0, 1, 4, 7, 256])
def test_prompt_pieces_tile_the_prompt(chunk):
    """Pieces are contiguous, cover every token once, never exceed the chunk, and (chunk a power of two)
    are powers of two falling after the full chunks: a graph per power of two covers every prompt."""
    for tokens in list(range(0, 70)) + [255, 256, 257, 500, 512]:
        pieces = prompt_pieces(tokens, chunk)
        assert [s for s, _ in pieces] == [sum(n for _, n in pieces[:i]) for i in range(len(pieces))]
        assert sum(n for _, n in pieces) == tokens
        if chunk == 0:
            assert pieces == ([(0, tokens)] if tokens else [])
            continue
        sizes = [n for _, n in pieces]
        assert max(sizes, default=0) <= chunk and sizes == sorted(sizes, reverse=True)
        tail = [n for n in sizes if n != chunk]
        assert len(tail) == len(set(tail)) and all(n & (n - 1) == 0 for n in tail)   # distinct powers of two
        if chunk & (chunk - 1) == 0:
            assert set(sizes) <= set(piece_sizes(chunk))
    assert prompt_pieces(500, 256) == [(0, 256), (256, 128), (384, 64), (448, 32), (480, 16), (496, 4)]


@pytest.mark.parametrize("largest", [0, 3, 100, -4])
def test_captured_pieces_need_a_power_of_two(largest):
    with pytest.raises(ValueError, match="engine.prefill_chunk_tokens"):
        piece_sizes(largest)


def test_prefill_graphs_settings_fail_loudly(tiny):
    model, tok, *_ = tiny
    with pytest.raises(ValueError, match="engine.prefill_graphs=true needs CUDA"):
        build_engine(model, tok, EngineConfig(max_calls=2, max_call_s=10.0, prefill_graphs=True))
    with pytest.raises(ValueError, match="engine.prefill_graphs must be auto, true or false"):
        build_engine(model, tok, EngineConfig(max_calls=2, max_call_s=10.0, prefill_graphs="sometimes"))
    eng = build_engine(model, tok, EngineConfig(max_calls=2, max_call_s=10.0))   # auto: eager on the CPU
    assert not eng.admission_graphs.prefills.graphs
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        ShapeGraphs(lambda: None, torch.device("cpu"), graphs=True)


def _admitted_state(model, prompt_ids, chunk, graphs_on: bool | None, device="cpu"):
    """A fresh state with slot 1 admitted: eager whole/pieces (graphs_on None) or through AdmissionGraphs."""
    st = allocate_call_state(model, 2, 50, torch.device(device), max_prompt_tokens=prompt_ids.numel())
    graphs = None
    if graphs_on is not None:
        graphs = AdmissionGraphs(model, st, chunk, graphs=graphs_on)
        graphs.capture()
    for _ in admission(model, st, 1, prompt_ids, 5, SamplingParams(), None, None, chunk, graphs):
        pass
    return st


def _slot_tensors(st, slot):
    """Every state pool's rows of `slot` (pools have a slot dim: the LLM's and the talker's pools), by name."""
    llm, talker = st.llm, st.talker
    return {"llm.conv": llm.conv[:, slot], "llm.ssm": llm.ssm[:, slot], "llm.k": llm.k[:, slot],
            "llm.v": llm.v[:, slot], "talker.k": talker.k[:, :, slot], "talker.v": talker.v[:, :, slot]}


def test_prefill_in_pieces_equals_whole_prefill(tiny):
    """A 45-token prompt prefilled in pieces of 16, 8, 4, 1 (through AdmissionGraphs' eager path, as the
    graphs run it) leaves the slot's LLM state and talker KV equal to one whole prefill's: fp32, within
    float rounding (atol 1e-5, rtol 1e-4); the slot's scalars equal."""
    model, tok, *_ = tiny
    ids = torch.randint(3, model.cfg.llm.vocab_size, (45,), generator=torch.Generator().manual_seed(0))
    whole = _admitted_state(model, ids, 0, None)
    pieces = _admitted_state(model, ids, 16, False)
    for name, t in _slot_tensors(whole, 1).items():
        torch.testing.assert_close(_slot_tensors(pieces, 1)[name], t, atol=1e-5, rtol=1e-4, msg=name)
    for name, t in state_tensors(whole):
        if t.dim() == 1:
            assert torch.equal(dict(state_tensors(pieces))[name], t), name
    # and the pieces moved the state: the SSM rows are not the zeros a reset leaves
    assert _slot_tensors(pieces, 1)["llm.ssm"].abs().max() > 0


def test_the_eager_admission_computes_a_speakers_warm_up_once(tiny, monkeypatch):
    """engine.prefill_graphs off (here: the CPU): the talker's warm-up is computed once per speaker and copied
    in. Three calls with prompts of their own (no prefix cache) run it once; an admission that copies it
    leaves every pool as the plain admission (frame_step.admission, which computes it) does, bit for bit."""
    from nemo_duplex.serving.drive import clip_plans, drive

    model, tok, *_ = tiny
    ids = torch.randint(3, model.cfg.llm.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    plain, copied = _admitted_state(model, ids, 0, None), _admitted_state(model, ids, 0, False)
    assert [n for (n, a), (_, b) in zip(state_tensors(plain), state_tensors(copied)) if not torch.equal(a, b)] == []

    computed = []
    warmup_kv = model.talker.warmup_kv
    monkeypatch.setattr(model.talker, "warmup_kv", lambda *a: computed.append(1) or warmup_kv(*a))
    eng = build_engine(model, tok, EngineConfig(max_calls=3, max_call_s=10.0, prefix_cache_mib=0))
    clip = torch.zeros(1280 * 2)
    drive(eng, [plan for i in range(3) for plan in clip_plans([clip], prompt=f"Prompt number {i}.", seed=i)])
    assert computed == [1]


@pytest.mark.gpu
def test_captured_admission_equals_eager_pieces_on_cuda(tiny):
    """On CUDA the graphs replay what the eager pieces compute, bit for bit (fp32 tiny model): every pool of
    the state, a 300-token prompt (pieces 256, 32, 8, 4) and one of 5, the default speaker's warm-up."""
    model = copy.deepcopy(tiny[0]).to("cuda")
    for n in (300, 5):
        ids = torch.randint(3, model.cfg.llm.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).cuda()
        eager = _admitted_state(model, ids, 256, None, "cuda")
        captured = _admitted_state(model, ids, 256, True, "cuda")
        for name, t in _slot_tensors(eager, 1).items():
            assert torch.equal(_slot_tensors(captured, 1)[name], t), (n, name)
        scalars = {name: t for name, t in state_tensors(captured) if t.dim() == 1}
        for name, t in state_tensors(eager):
            if t.dim() == 1:
                assert torch.equal(scalars[name], t), (n, name)
    graphs = AdmissionGraphs(model, allocate_call_state(model, 2, 50, torch.device("cuda"), max_prompt_tokens=16),
                             256, graphs=True)
    graphs.capture()
    # sizes up to the chunk that fit the LLM's pool (16 prompt tokens + 50 frames: 66 positions)
    assert sorted(graphs.prefills.keys) == [1, 2, 4, 8, 16, 32, 64] and len(graphs.warmup_writes.keys) == 1
    with pytest.raises(ValueError, match="captured for inputs of shape"):
        graphs.prefills(4, torch.zeros(1, 3, 8, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda"),
                        torch.zeros(1, dtype=torch.int64, device="cuda"))


@pytest.mark.gpu
def test_engine_serves_the_same_with_captured_admission(tiny, example_clip):
    """An engine with engine.prefill_graphs on gives a call with a prompt the text tokens and codes of the same
    engine admitting eagerly (the same pieces), bit for bit: fp32 tiny model, one capture bucket."""
    from nemo_duplex.serving.drive import clip_plans, drive

    model = copy.deepcopy(tiny[0]).to("cuda")
    kw = dict(max_calls=4, max_call_s=10.0, capture_buckets=[4], graphs=True, prefix_cache_mib=0)
    clip = example_clip[: 1280 * 10]
    served = {}
    for captured in (False, True):
        eng = build_engine(model, tiny[1], EngineConfig(**kw, prefill_graphs=captured))
        assert eng.admission_graphs.prefills.graphs == captured
        served[captured] = drive(eng, clip_plans([clip, clip], prompt="Answer in three short words, please.",
                                                 seed=2))
    for eager, graphed in zip(served[False], served[True]):
        assert torch.equal(eager.text_tokens, graphed.text_tokens) and torch.equal(eager.codes, graphed.codes)


@pytest.mark.gpu
def test_shape_graphs_replay_beside_other_graphs_without_sharing_a_gemm_workspace_on_cuda():
    """Two sets of captured bf16 GEMMs (skinny: the shapes cuBLASLt runs split-K, with partial sums and
    counters in its workspace) replayed at the same time on two streams, 200 times, each checked against
    its replay alone at capture. A graph keeps the workspace of the (thread, stream) it was recorded on, so
    two sets recorded on one capture stream would share it: sums corrupted, or a replay that never
    finishes (graphs/shapes.py). Bit for bit: every replay runs the same kernels."""
    import time

    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(16, 16384, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    wa, wb = (torch.randn(4096, 16384, device="cuda", generator=g, dtype=torch.bfloat16) / 128 for _ in range(2))
    out_a, out_b = (torch.empty(16, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    first = ShapeGraphs(lambda x: out_a.copy_(torch.nn.functional.linear(x, wa)), torch.device("cuda"), True)
    second = ShapeGraphs(lambda x: out_b.copy_(torch.nn.functional.linear(x, wb)), torch.device("cuda"), True)
    first.capture("a", a)
    second.capture("b", b)
    assert first.capture_stream != second.capture_stream
    want_a, want_b = out_a.clone(), out_b.clone()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for i in range(200):
        with torch.cuda.stream(s1):
            first("a", a)
        with torch.cuda.stream(s2):
            second("b", b)
        done = torch.cuda.Event()
        done.record(s1)
        s2.wait_event(done)
        done = torch.cuda.Event()
        done.record(s2)
        deadline = time.monotonic() + 30
        while not done.query():
            assert time.monotonic() < deadline, f"replay {i} did not finish in 30 s"
            time.sleep(0.001)
        assert torch.equal(out_a, want_a) and torch.equal(out_b, want_b), i
