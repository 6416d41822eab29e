"""Pipelined frame steps (engine.pipeline, frame_step's speech_slots and text_slots): one deep, the speech
half of a step is the previous frame's; two deep, the text half is too and the speech half the one before.
Every half's outputs must be the serial step's, bit for bit, one or two steps later, with calls that start,
drain and sit out steps at different times (fp32 tiny model, CPU). Every step runs ROWS rows
(sink padding), as engine.batch_invariant does: the CPU's GEMMs may round differently for other row
counts, which is not what this compares."""
import pytest
import torch

from nemo_duplex.models.config import SamplingParams
from nemo_duplex.serving.drive import clip_plans, drive
from nemo_duplex.serving.frame_step import admit, frame_step, special_ids
from nemo_duplex.serving.state import allocate_call_state

ROWS = 4


def _padded(rows, sink):
    """rows: (slot, text slot, speech slot, chunk) per row -> those four padded to ROWS (sink, silence)."""
    pad = [(sink, sink, sink, torch.zeros(1280))] * (ROWS - len(rows))
    slots, text, speech, chunks = zip(*(rows + pad))
    return torch.tensor(slots), torch.tensor(text), torch.tensor(speech), torch.stack(chunks)


def _state(model, n_calls: int, frames: int, sampling: SamplingParams, device=torch.device("cpu"),
           first_seed: int = 100):
    st = allocate_call_state(model, n_calls, frames, device, max_prompt_tokens=0)
    for s in range(n_calls):
        admit(model, st, s, None, first_seed + s, sampling)
    return st


def _assert_pipelined_step_is_serial(piped, serial, audio: torch.Tensor, depth: int, sink: int) -> None:
    """Runners `piped` (pipelined `depth` deep) and `serial` (the serial step) over the same calls' `audio`
    [calls, frames, 1280], each from its own state: every half of each piped step gives the serial step's
    outputs of that half's frame (its listening half this step's, text one step back two deep, speech `depth`
    steps back), bit for bit; a half with no frame runs on the sink."""
    n_calls, frames = audio.shape[:2]
    slots, forced = torch.arange(n_calls), torch.full((n_calls,), -1, dtype=torch.int64)
    expected = []
    for k in range(frames):
        out = serial(slots, audio[:, k], forced)
        expected.append([t.to("cpu", copy=True) for t in (out.user, out.text, out.codes, out.pcm)])
    none = torch.full((n_calls,), sink)
    for k in range(frames + depth):
        heard, text_k, speech_k = k, k - (depth - 1), k - depth
        out = piped(slots if heard < frames else none, audio[:, min(k, frames - 1)], forced,
                    speech=slots if speech_k >= 0 else none, text=slots if 0 <= text_k < frames else none)
        if heard < frames:
            assert torch.equal(out.user.cpu(), expected[heard][0]), k
        if 0 <= text_k < frames:
            assert torch.equal(out.text.cpu(), expected[text_k][1]), k
        if speech_k >= 0:
            assert torch.equal(out.codes.cpu(), expected[speech_k][2]), k
            assert torch.equal(out.pcm.cpu(), expected[speech_k][3]), k


@pytest.mark.parametrize("depth", [1, 2])
def test_pipelined_speech_equals_serial(tiny, depth):
    """One deep (speech_slots) and two deep (text_slots too): each half's outputs equal the serial step's
    for the same frame, bit for bit: the RNN-T tokens of the frame heard, the text of the frame a step
    back (two deep), the codes and PCM of the frame `depth` steps back."""
    model = tiny[0]
    torch.manual_seed(1)
    frames, n_calls = 6, 3
    # sampled text (temperature, top-p) so that the talker's and the sampler's draw counters both matter
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    audio = torch.randn(n_calls, frames, 1280) * 0.1
    specials = special_ids(model, torch.device("cpu"))
    no_force = torch.full((ROWS,), -1, dtype=torch.int64)

    serial = _state(model, n_calls, frames + 2, sampling)
    expected = {c: [] for c in range(n_calls)}
    for c in range(n_calls):      # each call alone, serially
        for k in range(frames):
            s, _, _, a = _padded([(c, c, c, audio[c, k])], serial.sink)
            out = frame_step(model, serial, s, a, no_force, specials)
            expected[c].append((out.user[0].clone(), out.text[0].item(), out.codes[0].clone(), out.pcm[0].clone()))

    # pipelined: call c starts at step c and hears frame step - c; its text half runs the frame
    # heard `depth - 1` steps back and its speech half the one `depth` steps back: each half's slot is
    # the call's while that frame exists, the sink otherwise (the first steps, and the drain)
    piped = _state(model, n_calls, frames + 2, sampling)
    sink = piped.sink
    got = {c: {"user": [], "text": [], "speech": []} for c in range(n_calls)}
    for step in range(frames + n_calls + depth):
        rows, owners = [], []
        for c in range(n_calls):
            k = step - c                       # the frame call c hears in this step
            ks = {"listen": k, "text": k - (depth - 1), "speech": k - depth}
            on = {half: 0 <= kk < frames for half, kk in ks.items()}
            if not any(on.values()):
                continue
            rows.append(tuple(c if on[h] else sink for h in ("listen", "text", "speech"))
                        + (audio[c, k] if on["listen"] else torch.zeros(1280),))
            owners.append((c, on))
        s, ts, ss, a = _padded(rows, sink)
        halves = dict(speech_slots=ss, text_slots=ts if depth == 2 else None)
        out = frame_step(model, piped, s, a, no_force, specials, **halves)
        for r, (c, on) in enumerate(owners):
            if on["listen"]:
                got[c]["user"].append(out.user[r].clone())
            if on["text"]:
                got[c]["text"].append(out.text[r].item())
            if on["speech"]:
                got[c]["speech"].append((out.codes[r].clone(), out.pcm[r].clone()))
    for c in range(n_calls):
        assert got[c]["text"] == [t for _, t, _, _ in expected[c]]
        assert all(torch.equal(u, e[0]) for u, e in zip(got[c]["user"], expected[c], strict=True))
        assert len(got[c]["speech"]) == frames
        for k, ((codes, pcm), (_, _, codes_e, pcm_e)) in enumerate(zip(got[c]["speech"], expected[c])):
            assert torch.equal(codes, codes_e), (c, k)
            assert torch.equal(pcm, pcm_e), (c, k)
    # every slot's state ends where the serial run left it
    for name in ("talker_pos", "speech_frame", "frame", "llm_len"):
        assert torch.equal(getattr(piped, name)[:n_calls], getattr(serial, name)[:n_calls]), name


# ---- the engine with engine.pipeline ------------------------------------------------------------------
def _engine(tiny, **kw):
    from nemo_duplex.serving.engine import build_engine
    from nemo_duplex.settings import EngineConfig
    model, tok, *_ = tiny
    return build_engine(model, tok, EngineConfig(**{"max_calls": 4, "max_call_s": 20.0, **kw}))


def _clips(example_clip, n, frames):
    g = torch.Generator().manual_seed(3)
    return [example_clip[i * 3840: i * 3840 + frames * 1280] + 0.01 * torch.randn(frames * 1280, generator=g)
            for i in range(n)]


@pytest.mark.parametrize("depth", [1, 2])
def test_pipelined_engine_equals_serial_engine(tiny, example_clip, depth):
    """Staggered live calls and uploads, sampled text: every call's text, function tokens, codes and PCM
    through the pipelined engine equal the serial engine's bit for bit (both batch-invariant: every step
    runs the same rows, so only the pipelining differs), every frame arrives, in order."""
    from nemo_duplex.models.config import SamplingParams
    frames = 7
    clips = _clips(example_clip, 5, frames)
    kw = dict(max_calls=5, batch_invariant=True)
    args = dict(offsets=[0, 2, 1, 4, 3], uploads=[False, True, False, False, True], seed=40,
                sampling=SamplingParams(temperature=0.7, top_p=0.9))
    serial = drive(_engine(tiny, **kw), clip_plans(clips, **args))
    piped_engine = _engine(tiny, pipeline=depth, **kw)
    piped = drive(piped_engine, clip_plans(clips, **args))
    for s, p in zip(serial, piped):
        assert p.text_tokens.shape[0] == frames
        assert torch.equal(s.text_tokens, p.text_tokens)
        assert torch.equal(s.function_tokens, p.function_tokens)
        assert torch.equal(s.codes, p.codes)
        assert torch.equal(s.wav, p.wav)
        assert s.user_tokens == p.user_tokens
    assert piped_engine.slots.in_use == 0


def test_sm_carveout_covers_the_text_half_only(tiny, monkeypatch):
    """engine.llm_sm_carveout: the carveout is set while the text half (LLM, heads) is queued, and only then:
    the encoder and the talker, queued before it, and whatever comes after see none; it is put back even when
    the text half raises. (Whether cuBLASLt honours it is the GPU's to show: docs/performance.md.)"""
    import torch._C as C
    model = tiny[0]
    current = {"sms": None}
    monkeypatch.setattr(C, "_get_sm_carveout_experimental", lambda: current["sms"], raising=False)
    monkeypatch.setattr(C, "_set_sm_carveout_experimental", lambda v: current.update(sms=v), raising=False)
    seen = {}

    def watch(obj, name, label):
        real = getattr(obj, name)

        def wrapped(*a, **k):
            seen.setdefault(label, set()).add(current["sms"])
            return real(*a, **k)
        monkeypatch.setattr(obj, name, wrapped)
    for obj, name, label in ((model.perception, "stream_step", "encoder"), (model.llm, "step", "llm"),
                             (model, "heads", "heads"), (model.talker, "step", "talker"),
                             (model.codec, "decode_step", "codec")):
        watch(obj, name, label)
    sampling = SamplingParams()
    specials = special_ids(model, torch.device("cpu"))
    outs = []
    for sms in (0, 16):
        st = _state(model, 2, 4, sampling)
        s, ts, ss, a = _padded([(0, 0, 0, torch.randn(1280) * 0.1), (1, 1, 1, torch.randn(1280) * 0.1)], st.sink)
        torch.manual_seed(0)
        outs.append(frame_step(model, st, s, a, torch.full((ROWS,), -1), specials, speech_slots=ss, text_slots=ts,
                               llm_sm_carveout=sms))
        assert current["sms"] is None
    assert seen == {"encoder": {None}, "llm": {16, None}, "heads": {16, None}, "talker": {None}, "codec": {None}}
    assert torch.equal(outs[0].text, outs[1].text) and torch.equal(outs[0].pcm, outs[1].pcm)

    def failing(*a, **k):
        raise RuntimeError("boom")
    monkeypatch.setattr(model.llm, "step", failing)
    st = _state(model, 2, 4, sampling)
    with pytest.raises(RuntimeError, match="boom"):
        frame_step(model, st, s, a, torch.full((ROWS,), -1), specials, llm_sm_carveout=16)
    assert current["sms"] is None


def test_sm_carveout_bounds(tiny):
    from nemo_duplex.serving.runner import build_runner
    model = tiny[0]
    st = _state(model, 1, 4, SamplingParams())
    specials = special_ids(model, torch.device("cpu"))
    with pytest.raises(ValueError, match="engine.llm_sm_carveout must be 0"):
        build_runner(model, st, specials, [1], graphs=False, llm_sm_carveout=-1)
    with pytest.raises(ValueError, match="not engine.graph_backend=reduce-overhead"):
        build_runner(model, st, specials, [1], graphs=True, backend="reduce-overhead", llm_sm_carveout=8)
    assert build_runner(model, st, specials, [1], graphs=False, llm_sm_carveout="8").step.llm_sm_carveout == 8
    with pytest.raises(ValueError, match="must be auto or an int, got 'half'"):
        build_runner(model, st, specials, [1], graphs=False, llm_sm_carveout="half")
    # "auto" on the CPU: no SMs to leave, whatever the depth
    assert build_runner(model, st, specials, [1], graphs=False, pipeline=2, llm_sm_carveout="auto").step.llm_sm_carveout == 0


def test_sm_carveout_auto_is_half_the_sms_two_deep_only(monkeypatch):
    """"auto" resolves to half the device's SMs only where a carveout is both usable and measured to help:
    two deep, steps captured by hand or eager, torch with the carveout; else 0. Explicit values are
    checked against the device's SM count."""
    from types import SimpleNamespace

    import torch._C as C

    from nemo_duplex.serving.runner import check_sm_carveout
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(C, "_set_sm_carveout_experimental", lambda v: None, raising=False)
    cuda = torch.device("cuda")
    assert check_sm_carveout("auto", cuda, pipeline=2, takes_carveout=True) == 66
    assert check_sm_carveout("auto", cuda, pipeline=1, takes_carveout=True) == 0
    assert check_sm_carveout("auto", cuda, pipeline=0, takes_carveout=True) == 0
    assert check_sm_carveout("auto", cuda, pipeline=2, takes_carveout=False) == 0   # reduce-overhead: no carveout
    assert check_sm_carveout(131, cuda) == 131
    with pytest.raises(ValueError, match=r"must be 0 \.\. 131, got 132"):
        check_sm_carveout(132, cuda)
    monkeypatch.delattr(C, "_set_sm_carveout_experimental")
    assert check_sm_carveout("auto", cuda, pipeline=2, takes_carveout=True) == 0
    with pytest.raises(ValueError, match="needs torch's SM carveout"):
        check_sm_carveout(8, cuda)


def test_pipeline_depth_out_of_range_is_refused(tiny):
    with pytest.raises(ValueError, match="engine.pipeline must be 0, 1 or 2"):
        _engine(tiny, pipeline=3)


@pytest.mark.parametrize("depth", [1, 2])
def test_pipelined_engine_runs_a_late_frames_speech_alone(tiny, example_clip, depth):
    """A live call whose next frame is late by a frame period gets its last frame's remaining halves (rows
    of their own, the sink on the listening half), one per period, without waiting for that frame. (The
    limit and abort rules, pipelined too: tests/test_engine.py.)"""
    import time

    from nemo_duplex.serving.calls import FrameEvent
    eng = _engine(tiny, max_calls=2, pipeline=depth)
    events = []
    call = eng.open_call(on_event=events.append)
    call.append(example_clip[: 1280].numpy())
    eng.tick()                                       # the frame is heard
    for _ in range(depth):
        assert not any(isinstance(e, FrameEvent) for e in events)
        eng.tick()                                   # not late yet: nothing to step
        time.sleep(eng.frame_seconds * 1.2)
        eng.tick()                                   # a period late: its next half runs alone
    assert [e.frame for e in events if isinstance(e, FrameEvent)] == [0]
    call.abort()
    eng.tick()
    assert eng.slots.in_use == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_compiled_pipelined_step_equals_serial(slim, depth):
    """The pipelined step as the default back end builds it (torch.compile of the whole step, fullgraph, with a
    dynamic batch; aot_eager on the CPU, which runs the traced graph with eager kernels and has no streams): it
    traces whole at each depth, and its halves give the serial eager step's outputs one or two steps later, bit
    for bit (fp32, the slim model: a layer of each kind; 3 calls over 6 frames in a bucket of ROWS)."""
    from nemo_duplex.serving.runner import build_runner
    model = slim[0]
    frames, n_calls = 6, 3
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    specials = special_ids(model, torch.device("cpu"))
    audio = torch.randn(n_calls, frames, 1280, generator=torch.Generator().manual_seed(5)) * 0.1
    states = [_state(model, n_calls, frames + 2, sampling) for _ in range(2)]
    torch._dynamo.reset()
    piped = build_runner(model, states[1], specials, [ROWS], graphs=True, backend="cudagraph",
                         compiler="aot_eager", pipeline=depth, dynamic_batch="auto")
    assert piped.dynamic_batch and piped.step.pipeline == depth
    piped.capture()
    serial = build_runner(model, states[0], specials, [ROWS], graphs=False, pad_eager=True)
    _assert_pipelined_step_is_serial(piped, serial, audio, depth, states[1].sink)


@pytest.mark.gpu
@pytest.mark.parametrize("backend, depth, carveout", [
    ("cudagraph-eager", 1, 0), ("cudagraph-eager", 2, 0), ("cudagraph-eager", 2, "auto"),
    pytest.param("cudagraph", 1, 0, id="compiled-1"), pytest.param("cudagraph", 2, 0, id="compiled-2")])
def test_captured_pipelined_step_equals_serial_on_the_gpu(tiny, backend, depth, carveout):
    """On CUDA the pipelined step's halves run on their own streams inside the captured graph
    (graphs/capture.py): the speech half beside the step's stream, and two deep the listening half too. A
    missed ordering between the streams would show here as tokens, codes or PCM that differ from the serial
    eager step's (same bucket rows on both sides, fp32 tiny model; compared bit for bit over 12 frames of 3
    calls). The hand capture (cudagraph-eager), with engine.llm_sm_carveout "auto" (half the SMs, two deep) on
    both sides too (the same SM target, so the same GEMM kernels); and the compiled default's build, whose
    fullgraph trace holds the stream switches and waits (compiled with aot_eager here, so its kernels are
    eager's and the comparison stays bit for bit; Inductor's own kernels at full size: tests/test_graphs.py)."""
    import copy

    from nemo_duplex.serving.runner import build_runner
    dev = torch.device("cuda")
    model = copy.deepcopy(tiny[0]).to(dev)
    frames, n_calls = 12, 3
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    specials = special_ids(model, dev)
    audio = torch.randn(n_calls, frames, 1280, generator=torch.Generator().manual_seed(5)) * 0.1
    states = [_state(model, n_calls, frames + 2, sampling, dev, first_seed=60) for _ in range(2)]
    torch._dynamo.reset()   # each compiled case traces afresh
    piped = build_runner(model, states[1], specials, [ROWS], graphs=True, backend=backend, pipeline=depth,
                         llm_sm_carveout=carveout, compiler="aot_eager", dynamic_batch="auto")
    assert (piped.step.llm_sm_carveout > 0) == (carveout == "auto")  # two deep, hand capture: half the SMs
    # the serial side with the SM target the pipelined step resolved ("auto" would be 0 there)
    serial = build_runner(model, states[0], specials, [ROWS], graphs=False, pad_eager=True,
                        llm_sm_carveout=piped.step.llm_sm_carveout)
    assert piped.step.speech_stream is not None and (piped.step.encoder_stream is not None) == (depth == 2)
    piped.capture()
    _assert_pipelined_step_is_serial(piped, serial, audio, depth, states[1].sink)
