"""Pipelined frame steps (engine.pipeline, frame_step's speech_slots): the speech half of a step is the
previous frame's. Its codes and audio must be the serial step's, bit for bit, one step later, with calls
that start, drain and sit out steps at different times (fp32 tiny model, CPU). Every step runs ROWS rows
(sink padding), as engine.batch_invariant does: the CPU's GEMMs may round differently for other row
counts, which is not what this compares."""
import pytest
import torch

from nemo_duplex.frame_step import admit, frame_step, special_ids
from nemo_duplex.sampling import SamplingParams
from nemo_duplex.state import allocate_call_state


ROWS = 4


def _padded(slots, speech, chunks, sink):
    pad = ROWS - len(slots)
    return (torch.tensor(slots + [sink] * pad), torch.tensor(speech + [sink] * pad),
            torch.stack(chunks + [torch.zeros(1280)] * pad), torch.full((ROWS,), -1, dtype=torch.int64))


def _state(model, n_calls: int, frames: int, sampling: SamplingParams):
    st = allocate_call_state(model, n_calls, frames, torch.device("cpu"), max_prompt_tokens=0)
    for s in range(n_calls):
        admit(model, st, s, None, 100 + s, sampling)
    return st


def test_pipelined_speech_equals_serial(tiny):
    model = tiny[0]
    torch.manual_seed(1)
    frames, n_calls = 6, 3
    # sampled text (temperature, top-p) so that the talker's and the sampler's draw counters both matter
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    audio = torch.randn(n_calls, frames, 1280) * 0.1
    specials = special_ids(model, torch.device("cpu"))

    serial = _state(model, n_calls, frames + 2, sampling)
    expected = {c: [] for c in range(n_calls)}
    for c in range(n_calls):      # each call alone, serially
        for k in range(frames):
            s, _, a, f = _padded([c], [c], [audio[c, k]], serial.sink)
            out = frame_step(model, serial, s, a, f, specials)
            expected[c].append((out.text[0].item(), out.codes[0].clone(), out.pcm[0].clone()))

    # pipelined: call c starts at step c; a call's row has its slot on the main half while it has frames,
    # and on the speech half from its second step through the step after its last frame (the drain)
    piped = _state(model, n_calls, frames + 2, sampling)
    sink = piped.sink
    got = {c: [] for c in range(n_calls)}
    texts = {c: [] for c in range(n_calls)}
    for step in range(frames + n_calls + 1):
        slots, speech, chunks = [], [], []
        for c in range(n_calls):
            k = step - c                       # the frame call c hears in this step
            main_row = 0 <= k < frames
            speech_row = 1 <= k <= frames
            slots.append(c if main_row else sink)
            speech.append(c if speech_row else sink)
            chunks.append(audio[c, k] if main_row else torch.zeros(1280))
        rows = [i for i in range(n_calls) if slots[i] != sink or speech[i] != sink]   # in-between rows padded
        s, ss, a, f = _padded([slots[i] for i in rows], [speech[i] for i in rows], [chunks[i] for i in rows], sink)
        out = frame_step(model, piped, s, a, f, specials, speech_slots=ss)
        for r, i in enumerate(rows):
            if slots[i] != sink:
                texts[i].append(out.text[r].item())
            if speech[i] != sink:
                got[i].append((out.codes[r].clone(), out.pcm[r].clone()))
    for c in range(n_calls):
        assert texts[c] == [t for t, _, _ in expected[c]]
        assert len(got[c]) == frames
        for k, ((codes, pcm), (_, codes_e, pcm_e)) in enumerate(zip(got[c], expected[c])):
            assert torch.equal(codes, codes_e), (c, k)
            assert torch.equal(pcm, pcm_e), (c, k)
    # every slot's state ends where the serial run left it
    assert torch.equal(piped.talker_pos[:n_calls], serial.talker_pos[:n_calls])
    assert torch.equal(piped.speech_frame[:n_calls], serial.speech_frame[:n_calls])
    assert torch.equal(piped.frame[:n_calls], serial.frame[:n_calls])


# ---- the engine with engine.pipeline ------------------------------------------------------------------
def _engine(tiny, **kw):
    from nemo_duplex.engine import Engine, EngineConfig
    model, tok, *_ = tiny
    return Engine(model, tok, EngineConfig(**{"max_calls": 4, "max_call_s": 20.0, **kw}))


def _clips(example_clip, n, frames):
    g = torch.Generator().manual_seed(3)
    return [example_clip[i * 3840: i * 3840 + frames * 1280] + 0.01 * torch.randn(frames * 1280, generator=g)
            for i in range(n)]


def test_pipelined_engine_equals_serial_engine(tiny, example_clip):
    """Staggered live calls and uploads, sampled text: every call's text, function tokens, codes and PCM
    through the pipelined engine equal the serial engine's bit for bit (both batch-invariant: every step
    runs the same rows, so only the pipelining differs), every frame arrives, in order."""
    from nemo_duplex.sampling import SamplingParams
    frames = 7
    clips = _clips(example_clip, 5, frames)
    kw = dict(max_calls=5, batch_invariant=True)
    args = dict(offsets=[0, 2, 1, 4, 3], uploads=[False, True, False, False, True], seed=40,
                sampling=SamplingParams(temperature=0.7, top_p=0.9))
    serial = _engine(tiny, **kw).run_clips(clips, **args)
    piped_engine = _engine(tiny, pipeline=True, **kw)
    piped = piped_engine.run_clips(clips, **args)
    for s, p in zip(serial, piped):
        assert p.text_tokens.shape[0] == frames
        assert torch.equal(s.text_tokens, p.text_tokens)
        assert torch.equal(s.function_tokens, p.function_tokens)
        assert torch.equal(s.codes, p.codes)
        assert torch.equal(s.wav, p.wav)
    assert piped_engine.slots.in_use == 0


def test_pipelined_engine_runs_a_late_frames_speech_alone(tiny, example_clip):
    """A live call whose next frame is late by a frame period gets its last frame's speech (a row of its
    own, the sink on the text half) without waiting for that frame. (The limit and abort rules, pipelined
    too: tests/test_engine.py.)"""
    import time

    from nemo_duplex.engine import FrameEvent
    eng = _engine(tiny, max_calls=2, pipeline=True)
    events = []
    call = eng.open_call(on_event=events.append)
    call.append(example_clip[: 1280].numpy())
    eng.tick()                                       # the frame's text half
    assert not any(isinstance(e, FrameEvent) for e in events)
    time.sleep(eng.frame_seconds * 1.2)
    eng.tick()                                       # a period late: its speech runs alone
    assert [e.frame for e in events if isinstance(e, FrameEvent)] == [0]
    call.abort()
    eng.tick()
    assert eng.slots.in_use == 0


@pytest.mark.gpu
def test_captured_pipelined_step_equals_serial_on_the_gpu(tiny):
    """On CUDA the pipelined step's speech half runs on its own stream inside the captured graph
    (graphs/capture.py, cudagraph-eager), beside the encoder and LLM on the step's stream: a missed
    ordering between the streams would show here as codes or PCM that differ from the serial eager step's
    (same bucket rows on both sides, fp32 tiny model; compared bit for bit over 12 frames of 3 calls)."""
    import copy

    from graphs.capture import StepRunner
    dev = torch.device("cuda")
    model = copy.deepcopy(tiny[0]).to(dev)
    frames, n_calls = 12, 3
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    specials = special_ids(model, dev)
    audio = torch.randn(n_calls, frames, 1280, generator=torch.Generator().manual_seed(5)) * 0.1
    states = [allocate_call_state(model, n_calls, frames + 2, dev, max_prompt_tokens=0) for _ in range(2)]
    for st in states:
        for s in range(n_calls):
            admit(model, st, s, None, 60 + s, sampling)
    serial = StepRunner(model, states[0], specials, [ROWS], graphs=False, pad_eager=True)
    piped = StepRunner(model, states[1], specials, [ROWS], graphs=True, backend="cudagraph-eager", pipeline=True)
    assert piped.speech_stream is not None
    piped.capture()
    sink = states[1].sink
    slots = torch.arange(n_calls)
    forced = torch.full((n_calls,), -1, dtype=torch.int64)
    expected = []
    for k in range(frames):
        out = serial(slots, audio[:, k], forced)
        expected.append((out.text.cpu(), out.codes.cpu(), out.pcm.cpu()))
    for k in range(frames + 1):
        main = slots if k < frames else torch.full((n_calls,), sink)
        speech = slots if k > 0 else torch.full((n_calls,), sink)
        out = piped(main, audio[:, min(k, frames - 1)], forced, speech=speech)
        if k < frames:
            assert torch.equal(out.text.cpu(), expected[k][0]), k
        if k > 0:
            assert torch.equal(out.codes.cpu(), expected[k - 1][1]), k
            assert torch.equal(out.pcm.cpu(), expected[k - 1][2]), k
