"""The batched engine: live == upload == offline, batch invariance, slot hygiene, prefix cache,
tool-result injection, limits. Tiny model, CPU, fp32. One file past 500 lines on purpose: the engine's
contract in one place (its pages are tests/test_pages.py, its pipeline tests/test_pipeline.py)."""
import threading
import time

import numpy as np
import pytest
import torch

from graphs.capture import HostStepper
from nemo_duplex.models.model import offline_inference
from nemo_duplex.serving.calls import (
    CallClosed,
    CallOptions,
    DrainedEvent,
    EndedEvent,
    EngineBusy,
    FrameEvent,
    InputBudgetExceeded,
)
from nemo_duplex.serving.drive import clip_plans, drive
from nemo_duplex.serving.engine import build_engine
from nemo_duplex.serving.frame_step import stream_inference
from nemo_duplex.settings import EngineConfig
from tests.call_events import CallEvents


def _engine(tiny, **kw):
    model, tok, *_ = tiny
    return build_engine(model, tok, EngineConfig(**{"max_calls": 4, "max_call_s": 20.0, **kw}))


def _hold_admissions(monkeypatch, hold) -> threading.Event:
    """From now on every admission (serving/engine.py's `admission`) sets the returned event, runs `hold()`
    (a sleep: a slow admission; a wait: a hung one), then admits as usual."""
    from nemo_duplex.serving import engine as engine_mod

    admission, entered = engine_mod.admission, threading.Event()

    def held(*args, **kwargs):
        entered.set()
        hold()
        yield from admission(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "admission", held)
    return entered


def _clips(example_clip, n, frames, seed=0):
    """n distinct clips: slices of the example clip plus seeded noise."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        start = (i * 3 * 1280) % (example_clip.shape[0] - frames * 1280)
        out.append(example_clip[start: start + frames * 1280] + 0.01 * torch.randn(frames * 1280, generator=g))
    return out


def test_live_equals_upload_equals_offline(tiny, example_clip):
    model, tok, *_ = tiny
    clip = example_clip[: 1280 * 20]
    for prompt in (None, "Be brief."):
        live, upload = drive(_engine(tiny), clip_plans([clip, clip], prompt=prompt, uploads=[False, True], seed=5))
        ids = model.prompt_ids(tok, prompt)
        off = offline_inference(model, clip, ids, seed=5)
        assert live.text_tokens.shape[0] == upload.text_tokens.shape[0] == 20
        # the two calls have seeds 5 and 6: text (greedy) is seed independent, codes are not
        assert torch.equal(live.text_tokens, upload.text_tokens)
        assert torch.equal(live.function_tokens, upload.function_tokens)
        assert torch.equal(live.text_tokens, off.text_tokens[:20])
        assert live.wav.shape[0] == 20 * 1764


def test_codes_equal_the_streaming_loop_and_depend_on_the_seed(tiny, example_clip):
    model, *_ = tiny
    clip = example_clip[: 1280 * 10]
    eng = _engine(tiny)
    a, b = drive(eng, clip_plans([clip, clip], seed=3))          # seeds 3 and 4
    ref = stream_inference(model, clip, seed=3)
    assert torch.equal(a.codes, ref.codes) and torch.equal(a.text_tokens, ref.text_tokens)
    # PCM: batched fp32 convolutions round differently per batch size; within one int16 step
    assert (a.wav - ref.wav).abs().max() < 1 / 32768
    assert not torch.equal(a.codes, b.codes)


def test_batch_invariance_with_staggered_calls_and_uploads(tiny, example_clip):
    """A call's tokens and codes are identical alone and in a batch of 8 other calls that started at
    different times, with uploads mixed in."""
    frames = 12
    clips = _clips(example_clip, 9, frames)
    alone = drive(_engine(tiny, max_calls=1), clip_plans([clips[0]], seed=11))[0]
    offsets = [4, 0, 1, 2, 3, 5, 6, 7, 9]
    uploads = [False, True, False, True, False, False, True, False, False]
    mixed = drive(_engine(tiny, max_calls=9), clip_plans(clips, offsets=offsets, uploads=uploads, seed=11))
    # the engine gives clip i seed 11 + i; compare clip 0 (seed 11) with the lone call (seed 11)
    assert torch.equal(mixed[0].text_tokens, alone.text_tokens)
    assert torch.equal(mixed[0].codes, alone.codes)
    assert (mixed[0].wav - alone.wav).abs().max() < 1 / 32768   # within one int16 step (see above)
    assert all(r.text_tokens.shape[0] == frames for r in mixed)


def test_batch_invariant_engine_is_bit_for_bit(tiny, example_clip):
    """engine.batch_invariant: one bucket, eager steps padded to it, so every step runs the same rows. A
    call's text, codes AND PCM are then identical bit for bit alone and beside 8 staggered calls with
    uploads mixed in (with the default engine the PCM is only within one int16 step, above: the CPU's
    kernels round differently for other row counts); every step ran the one bucket's rows (16: the
    configured bucket that covers max_calls 9)."""
    frames = 10
    clips = _clips(example_clip, 9, frames, seed=1)
    alone_eng = _engine(tiny, max_calls=9, batch_invariant=True)
    assert alone_eng.step_runner.buckets == [16] and alone_eng.step_runner.padded_rows(1) == 16
    alone = drive(alone_eng, clip_plans([clips[0]], seed=21))[0]
    mixed = drive(_engine(tiny, max_calls=9, batch_invariant=True), clip_plans(
        clips, offsets=[3, 0, 1, 2, 4, 5, 6, 7, 8], uploads=[False, True, False, False, True, False, False, True, False],
        seed=21))
    assert torch.equal(mixed[0].text_tokens, alone.text_tokens)
    assert torch.equal(mixed[0].codes, alone.codes)
    assert torch.equal(mixed[0].wav, alone.wav)
    assert alone_eng.stats.padded_rows == 16 * alone_eng.stats.steps


def test_slot_hygiene_many_short_calls(tiny, example_clip):
    """1,000 short calls through 4 slots leave no slot taken and no state from one call in the next: a
    reused slot gives the same output as a fresh engine. The calls end every way a call can end: after a
    frame of audio, at end of input with no audio, and by abort (before or after admission)."""
    eng = _engine(tiny, max_calls=4)
    clip = example_clip[1280 * 8: 1280 * 10]
    fresh = drive(_engine(tiny, max_calls=4), clip_plans([clip], seed=7))[0]
    ended = []
    for start in range(0, 1000, 4):
        calls = [eng.open_call(CallOptions(seed=100 + start + i), on_event=ended.append) for i in range(4)]
        for i, c in enumerate(calls):
            kind = (start + i) % 4
            if kind == 0:
                c.append(clip[:1280].numpy())
            if kind == 3:
                c.abort("aborted", "hung up before admission")
            elif kind != 2:
                c.end_input()
        eng.tick()
        for c in calls:
            if (start + calls.index(c)) % 4 == 2 and not c.closed:
                c.abort("aborted", "hung up after admission")
        while any(not c.closed for c in calls):
            eng.tick()
    assert eng.slots.in_use == 0
    reasons = [e.reason for e in ended if isinstance(e, EndedEvent)]
    assert len(reasons) == 1000 and reasons.count("completed") == 500 and reasons.count("aborted") == 500
    assert sum(isinstance(e, FrameEvent) for e in ended) == 250
    again = drive(eng, clip_plans([clip], seed=7))[0]
    assert torch.equal(again.codes, fresh.codes) and torch.equal(again.text_tokens, fresh.text_tokens)
    assert eng.prefix_cache.hits >= 500     # same (no prompt, speaker): admission copied, not recomputed


def test_prefix_cache_copy_equals_fresh_admission(tiny, example_clip):
    """A prompt is cached on its second admission (the doorkeeper) and copied in from the third on; the copy
    equals a fresh admission bit for bit."""
    clip = example_clip[: 1280 * 8]
    cached = _engine(tiny)
    first = drive(cached, clip_plans([clip], prompt="Say hello.", seed=2))[0]
    drive(cached, clip_plans([clip], prompt="Say hello.", seed=2))                  # seen twice: now cached
    assert cached.prefix_cache.hits == 0 and len(cached.prefix_cache._entries) == 1
    third = drive(cached, clip_plans([clip], prompt="Say hello.", seed=2))[0]   # admitted from the cache
    uncached = drive(_engine(tiny, prefix_cache_mib=0), clip_plans([clip], prompt="Say hello.", seed=2))[0]
    assert cached.prefix_cache.hits == 1
    for r in (third, uncached):
        assert torch.equal(r.text_tokens, first.text_tokens) and torch.equal(r.codes, first.codes)


def test_fresh_prompts_do_not_flush_the_prefix_cache(tiny, example_clip):
    """A shared prompt cached, then 20 calls each with a prompt of its own: the shared prompt is still a hit
    after them, and none of the fresh ones took an entry (the doorkeeper: a prompt enters on its second
    admission)."""
    clip = example_clip[: 1280 * 2]
    eng = _engine(tiny)
    for _ in range(2):
        drive(eng, clip_plans([clip], prompt="Be brief."))
    for i in range(20):
        drive(eng, clip_plans([clip], prompt=f"Fresh prompt number {i}."))
    hits = eng.prefix_cache.hits
    drive(eng, clip_plans([clip], prompt="Be brief."))
    assert eng.prefix_cache.hits == hits + 1 and len(eng.prefix_cache._entries) == 1


@pytest.mark.parametrize("pipeline", [0, 2])
def test_chunked_admission_equals_whole_and_never_stalls_live_calls(tiny, example_clip, pipeline, monkeypatch):
    """A long prompt's admission runs in pieces (engine.prefill_chunk_tokens = 4 tokens a piece here), at
    most engine.admission_pieces_per_tick between two steps while another call is live; the call then gives
    the tokens and codes of the same call admitted whole (greedy; fp32 chunked prefill equals the whole one
    within float rounding, which moves no token or code here)."""
    model, tok, *_ = tiny
    prompt = "You are a helpful assistant who answers briefly and kindly. " * 3
    assert model.prompt_ids(tok, prompt).numel() > 40
    clip = example_clip[: 1280 * 12]
    whole = drive(_engine(tiny, prefill_chunk_tokens=0, prefix_cache_mib=0, pipeline=pipeline),
                  clip_plans([clip], prompt=prompt, seed=3))[0]

    eng = _engine(tiny, prefill_chunk_tokens=4, admission_pieces_per_tick=2, prefix_cache_mib=0,
                  pipeline=pipeline)
    trace = []
    prefill, step_to_host = model.llm.prefill, eng.step_runner.step_to_host

    def traced_prefill(*args, **kwargs):
        trace.append("c")
        return prefill(*args, **kwargs)

    def traced_step(*args, **kwargs):
        trace.append("s")
        return step_to_host(*args, **kwargs)

    monkeypatch.setattr(model.llm, "prefill", traced_prefill)
    monkeypatch.setattr(eng.step_runner, "step_to_host", traced_step)
    live = eng.open_call(CallOptions(seed=1))
    eng.tick()                                   # admitted (no prompt: one piece)
    live.append(example_clip[: 1280 * 40].numpy())
    chunked = drive(eng, clip_plans([clip], prompt=prompt, seed=3))[0]
    runs = "".join(trace).split("s")
    assert sum(map(len, runs)) >= 10 and max(map(len, runs)) <= 2, "".join(trace)
    assert torch.equal(chunked.text_tokens, whole.text_tokens) and torch.equal(chunked.codes, whole.codes)


def _injected_call(eng, clip, n_frames: int, inject) -> list:
    """One call, admitted, then `inject(call)` forcing tokens before any audio, then `n_frames` frames of
    `clip` and end_input, ticked until it closes -> its events."""
    events = []
    call = eng.open_call(CallOptions(seed=1), on_event=events.append)
    eng.tick()                                  # admission
    inject(call)
    call.append(clip[: 1280 * n_frames].numpy())
    call.end_input()
    while not call.closed:
        eng.tick()
    return events


@pytest.mark.parametrize("pipeline", [0, 1, 2])
def test_tool_result_injection_forces_function_channel(tiny, example_clip, pipeline):
    """Pipelined, a frame's forced token goes with it to its text half, a step after it was heard when two
    deep: the same frames carry it."""
    eng = _engine(tiny, pipeline=pipeline)
    injected = [300, 301, 302]
    events = _injected_call(eng, example_clip, 6, lambda call: call.inject_function_tokens(injected))
    frames = [e for e in events if isinstance(e, FrameEvent)]
    assert [f.func for f in frames[:3]] == injected
    assert all(f.text == 12 for f in frames[:3])    # the text channel is forced to PAD meanwhile
    assert isinstance(events[-2], DrainedEvent) and events[-1].reason == "completed"


@pytest.mark.parametrize("pipeline", [0, 2])
def test_forced_text_reaches_the_talker(tiny, example_clip, pipeline, monkeypatch):
    """An on-hold message's tokens forced onto the text channel (Call.inject_text_tokens) are the frames'
    text tokens and the talker's text input for those frames (it voices them). Also two deep, where the speech half runs a
    step later."""
    model, *_ = tiny
    eng = _engine(tiny, pipeline=pipeline)
    talker_text = []
    step = model.talker.step

    def recording_step(text, prev_codes, cache, slots, *args, **kwargs):
        talker_text.extend(int(t) for t, s in zip(text.tolist(), slots.tolist()) if s != eng.state.sink)
        return step(text, prev_codes, cache, slots, *args, **kwargs)

    monkeypatch.setattr(model.talker, "step", recording_step)
    t = model.cfg.tokens
    message = [t.bos_id, 300, 301, 302, t.eos_id]
    events = _injected_call(eng, example_clip, 8, lambda call: call.inject_text_tokens(message))
    frames = [e for e in events if isinstance(e, FrameEvent)]
    assert [f.text for f in frames[:5]] == message
    assert talker_text[:5] == message and len(talker_text) == len(frames) == 8
    assert talker_text[5:] == [f.text for f in frames[5:]]     # then the model's own tokens


@pytest.mark.parametrize("pipeline", [0, 1, 2])
def test_limits_busy_budget_and_call_length(tiny, example_clip, pipeline):
    """Also pipelined (engine.pipeline): the limit still hands out every stepped frame, the last ones' halves
    in rows of their own."""
    eng = _engine(tiny, max_calls=2, max_call_s=0.4, max_pending_s=0.5, pipeline=pipeline)
    events = []
    a = eng.open_call(on_event=events.append)
    eng.open_call()
    with pytest.raises(EngineBusy, match="engine.max_calls"):
        eng.open_call()
    with pytest.raises(InputBudgetExceeded, match="engine.max_pending_s"):
        a.append(np.zeros(16000, dtype=np.float32))
    a.append(np.zeros(1280 * 6, dtype=np.float32))   # 0.48 s: within the budget, past the 0.4 s call limit
    for _ in range(10):
        eng.tick()
    ended = [e for e in events if isinstance(e, EndedEvent)]
    assert ended and ended[0].reason == "limit" and "engine.max_call_s" in ended[0].message
    assert [e.frame for e in events if isinstance(e, FrameEvent)] == [0, 1, 2, 3, 4]
    with pytest.raises(CallClosed):
        a.append(np.zeros(1280, dtype=np.float32))
    assert eng.slots.in_use == 1                      # the other call still holds its slot


@pytest.mark.parametrize("pipeline", [0, 2])
@pytest.mark.parametrize("then", ["end_input", "one_more_sample"])
def test_a_call_at_its_limit_waits_for_what_comes_next(tiny, pipeline, then):
    """Input of exactly engine.max_call_s whose end-of-input arrives after its last frame was stepped
    completes (the server's client sends its end a moment later: a race CI once lost); a single sample
    past the limit ends it with "limit"."""
    eng = _engine(tiny, max_calls=2, max_call_s=0.4, pipeline=pipeline)
    events = []
    a = eng.open_call(on_event=events.append)
    a.append(np.zeros(1280 * 5, dtype=np.float32))    # exactly 0.4 s
    for _ in range(12):                                # every frame stepped and handed out, nothing next
        eng.tick()
    assert not a.closed and [e.frame for e in events if isinstance(e, FrameEvent)] == [0, 1, 2, 3, 4]
    if then == "end_input":
        a.end_input()
    else:
        a.append(np.zeros(1, dtype=np.float32))
    for _ in range(4):
        eng.tick()
    ended = [e for e in events if isinstance(e, EndedEvent)]
    assert len(ended) == 1 and ended[0].reason == ("completed" if then == "end_input" else "limit")
    assert eng.slots.in_use == 0


@pytest.mark.parametrize("pipeline", [0, 1, 2])
def test_abort_frees_slot_and_others_continue(tiny, example_clip, pipeline):
    eng = _engine(tiny, max_calls=2, pipeline=pipeline)
    ev_a, ev_b = [], []
    a = eng.open_call(on_event=ev_a.append)
    b = eng.open_call(on_event=ev_b.append)
    a.append(example_clip[: 1280 * 4].numpy())
    b.append(example_clip[: 1280 * 4].numpy())
    eng.tick()
    eng.tick()
    a.abort("aborted", "client hung up")
    eng.tick()
    assert a.closed and eng.slots.in_use == 1
    assert ev_a[-1].reason == "aborted"
    b.end_input()
    while not b.closed:
        eng.tick()
    assert [e.frame for e in ev_b if isinstance(e, FrameEvent)] == [0, 1, 2, 3] and ev_b[-1].reason == "completed"
    eng.open_call()                                   # the freed slot is usable


def test_device_error_stops_the_engine_and_refuses_new_calls(tiny, example_clip):
    """A CUDA error poisons the process's context, so the engine thread ends every call with the reason
    and stops (/health then says engine_down); later calls are refused with engine_down, not failed one
    by one. Any other exception only ends the calls of that step (the engine keeps serving)."""

    from nemo_duplex.serving.calls import EngineDown

    for message, stops in (("boom: a plain bug", False), ("CUDA error: device-side assert triggered", True)):
        eng = _engine(tiny, max_calls=2)
        real_runner = eng.step_runner

        class FailingStep(HostStepper):
            def step_to_host(self, *args, _msg=message, **kwargs):
                eng.step_runner = real_runner  # fail once
                raise RuntimeError(_msg)
        eng.start()  # captures with the real runner
        eng.step_runner = FailingStep()
        events = []
        call = eng.open_call(on_event=events.append)
        call.append(example_clip[: 1280 * 2].numpy())
        deadline = time.monotonic() + 30
        # the ended event, not call.closed: the engine marks the call closed just before it delivers the event
        while not (events and isinstance(events[-1], EndedEvent)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert call.closed and events[-1].reason == "error" and message.split(":")[0] in events[-1].message
        assert eng.slots.in_use == 0
        if stops:
            eng._thread.join(timeout=10)
            assert not eng._thread.is_alive() and "CUDA error" in eng.down
            with pytest.raises(EngineDown, match="needs a restart"):
                eng.open_call()
        else:
            assert eng._thread.is_alive() and eng.down is None
            again = eng.open_call()  # still serving
            again.end_input()
        eng.stop()


def _two_paced_calls(eng, frame, gap_s, last_step_s=1.0):
    """Start eng with two calls a and b; after a first frame each (no rhythm yet: stepped as they come),
    a's second frame, then b's gap_s later. The engine is told its last step took last_step_s (the
    coalescing bound is at most that; the tiny model's CPU steps take a few ms). Returns (a, b, stepped,
    batch sizes from the second frames on as a callable): stepped(n) waits until n frames have been
    stepped."""

    eng.start()
    a, b = eng.open_call(), eng.open_call()
    while not (a.admitted and b.admitted):
        time.sleep(0.01)
    deadline = time.monotonic() + 60

    def stepped(frames):
        while eng.stats.frames < frames and time.monotonic() < deadline:
            time.sleep(0.01)

    a.append(frame)
    b.append(frame)
    stepped(2)
    first_steps = len(eng.stats.batch_sizes)
    eng._last_step = (time.monotonic(), last_step_s)   # set before stats count the frames: no race
    a.append(frame)
    time.sleep(gap_s)
    b.append(frame)
    stepped(4)
    return a, b, stepped, lambda: list(eng.stats.batch_sizes)[first_steps:]


def test_coalescing_steps_frames_that_arrive_together(tiny, example_clip):
    """engine.coalesce_ms: a frame waits (bounded) for the frames of live calls that are due, so two
    calls whose frames arrive 50 ms apart share one step; a call whose partner sends nothing more is
    stepped after the bound, never held forever."""

    frame = example_clip[:1280].numpy()
    eng = _engine(tiny, max_calls=2, coalesce_ms=400.0)
    a, b, stepped, batches = _two_paced_calls(eng, frame, 0.05)
    assert batches() == [2]
    t0 = time.monotonic()
    eng._last_step = (t0, 1.0)   # as in _two_paced_calls: a bound of 400 ms, not the CPU step's few ms
    a.append(frame)  # b sends nothing more: a is stepped alone once its frame is 400 ms old
    stepped(5)
    waited = time.monotonic() - t0
    assert batches() == [2, 1] and 0.35 < waited < 10
    eng.stop()


def test_a_call_that_went_quiet_holds_no_step(tiny, example_clip):
    """frame_due in the engine: two calls share a step, then b goes quiet (its next frame over a period
    late: a push-to-talk client between turns, a parked connection). a's next frame is stepped at once,
    not held up to the bound (2 s here) for b, which stepped frames before the rule."""
    frame = example_clip[:1280].numpy()
    eng = _engine(tiny, max_calls=2, coalesce_ms=2000.0)
    a, b, stepped, batches = _two_paced_calls(eng, frame, 0.05)
    assert batches() == [2]
    time.sleep(0.25)   # b's next frame was due 80 ms after its last: now over a period late
    eng._last_step = (time.monotonic(), 5.0)   # a bound of 2 s, not the CPU step's few ms
    t0 = time.monotonic()
    a.append(frame)
    stepped(5)
    waited = time.monotonic() - t0
    assert batches() == [2, 1] and waited < 1.5, (batches(), waited)
    eng.stop()


@pytest.mark.parametrize("last_step_s,at_most_step", [(1.0, True), (0.02, True), (0.02, False)])
def test_coalescing_bound_is_at_most_one_step(tiny, example_clip, last_step_s, at_most_step):
    """engine.coalesce_ms is capped by the last step's time (coalesce_limit). Bound 400 ms, frames 150 ms
    apart: after a 1 s step they share a step; after a 20 ms step they are stepped apart, unless
    engine.coalesce_at_most_step is off."""
    frame = example_clip[:1280].numpy()
    eng = _engine(tiny, max_calls=2, coalesce_ms=400.0, coalesce_at_most_step=at_most_step)
    _, _, _, batches = _two_paced_calls(eng, frame, 0.15, last_step_s=last_step_s)
    assert batches() == ([2] if last_step_s > 0.15 or not at_most_step else [1, 1])
    eng.stop()


@pytest.mark.parametrize("quiet_ms, admission_thread", [(0.0, False), (250.0, False), (250.0, True)])
def test_calls_opening_together_share_their_first_step(tiny, example_clip, quiet_ms, admission_thread):
    """engine.open_quiet_ms: four calls open 100 ms apart, each sending its first frame as it opens (no
    rhythm yet). With a 250 ms quiet time the first step waits for the openings (bound 1 s) and takes all
    four first frames; with 0 the first call's frame is stepped alone at once. With the admission thread the
    four are admitted one after another there, and the first admitted holds its frame for the others."""

    frame = example_clip[:1280].numpy()
    eng = _engine(tiny, max_calls=4, coalesce_ms=1000.0, open_quiet_ms=quiet_ms, admission_thread=admission_thread)
    eng.start()
    calls = []
    for _ in range(4):
        calls.append(eng.open_call())
        calls[-1].append(frame)
        time.sleep(0.1)
    deadline = time.monotonic() + 60
    while eng.stats.frames < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    batches = list(eng.stats.batch_sizes)
    if quiet_ms:
        assert batches == [4]
    else:
        assert batches[0] == 1 and sum(batches) == 4
    eng.stop()


@pytest.mark.parametrize("open_gap_s,wait", [(0.0, True), (0.3, True), (0.0, False)])
def test_calls_opened_together_share_their_first_step(tiny, example_clip, open_gap_s, wait):
    """opened_together: four calls open (back to back, or 300 ms apart), then send their first frames
    40 ms apart (no rhythm yet). Opened together, the first step waits for them (bound 200 ms) and takes
    all four; opened 300 ms apart (past the bound), or with engine.wait_opened_together off, the first
    call's frame is stepped alone at once."""

    frame = example_clip[:1280].numpy()
    eng = _engine(tiny, max_calls=4, coalesce_ms=200.0, open_quiet_ms=0.0, wait_opened_together=wait)
    eng.start()
    calls = []
    for _ in range(4):
        calls.append(eng.open_call())
        time.sleep(open_gap_s)
    while not all(c.admitted for c in calls):
        time.sleep(0.01)
    for c in calls:
        c.append(frame)
        time.sleep(0.04)
    deadline = time.monotonic() + 60
    while eng.stats.frames < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    batches = list(eng.stats.batch_sizes)
    if open_gap_s or not wait:
        assert batches[0] == 1 and sum(batches) == 4
    else:
        assert batches == [4]
    eng.stop()


def test_opened_together_rule():
    """opened_together on made-up open times (seconds, sorted), bound 0.015: within the bound of any call
    whose first frame is pending (before or after it), or not; no such call, nothing to go by."""
    from nemo_duplex.serving.pacing import opened_together

    assert opened_together(10.004, [10.000], 0.015)
    assert opened_together(9.990, [10.000, 12.0], 0.015)
    assert opened_together(11.99, [9.0, 10.000, 12.0], 0.015)
    assert not opened_together(10.030, [10.000], 0.015)
    assert not opened_together(10.030, [9.0, 10.000, 10.050], 0.015)
    assert not opened_together(10.0, [], 0.015)


def test_coalesce_limit_and_deadline():
    """coalesce_limit: engine.coalesce_ms capped by the last step's seconds (none yet: the bound itself;
    0 = off). coalesce_deadline: the oldest paced frame (alone in its call) + the bound; backlogs and
    calls without a frame do not set it."""
    from nemo_duplex.serving.pacing import coalesce_deadline, coalesce_limit

    assert coalesce_limit(0.015, None) == 0.015
    assert coalesce_limit(0.015, (10.0, 0.012)) == 0.012
    assert coalesce_limit(0.015, (10.0, 0.040)) == 0.015
    assert coalesce_limit(0.0, (10.0, 0.012)) == 0.0
    assert coalesce_deadline([(10.000, 10.000, 1), (10.004, 10.004, 1), (None, 9.9, 0)], 0.02) == pytest.approx(10.02)
    assert coalesce_deadline([(8.0, 10.0, 40), (10.004, 10.004, 1)], 0.02) == pytest.approx(10.024)
    assert coalesce_deadline([(8.0, 10.0, 40), (None, 9.9, 0)], 0.02) is None


def test_coalesce_wait_rule():
    """coalesce_wait on made-up arrival times (seconds; frames every 0.08 s, bound 0.02 s); per call
    (oldest pending frame's arrival, last frame's arrival, frames pending)."""
    from nemo_duplex.serving.pacing import coalesce_wait

    F, L = 0.08, 0.02
    # lockstep: b's next frame is due with a's (its last came one period before a's): wait to the bound
    assert coalesce_wait([(10.000, 10.000, 1), (None, 9.921, 0)], 10.003, L, F) == pytest.approx(0.017)
    # staggered: b's next frame is due 40 ms after a's, past the bound: step now
    assert coalesce_wait([(10.000, 10.000, 1), (None, 9.960, 0)], 10.003, L, F) == 0.0
    # the engine was busy: the oldest pending frame is older than the bound, step now whatever is due
    assert coalesce_wait([(10.000, 10.000, 1), (None, 9.930, 0)], 10.025, L, F) == 0.0
    # every live call has a frame, or nothing is pending, or b has never sent a frame: no wait
    assert coalesce_wait([(10.000, 10.000, 1), (10.002, 10.002, 1)], 10.003, L, F) == 0.0
    assert coalesce_wait([(None, 9.95, 0), (None, 9.93, 0)], 10.003, L, F) == 0.0
    assert coalesce_wait([(10.000, 10.000, 1), (None, None, 0)], 10.003, L, F) == 0.0
    # a call late by less than a period (jitter) is waited for, up to the bound...
    assert coalesce_wait([(10.000, 10.000, 1), (None, 9.85, 0)], 10.003, L, F) == pytest.approx(0.017)
    # ...one that went quiet (its next frame a period late or more: push-to-talk, a parked connection) is not
    assert coalesce_wait([(10.000, 10.000, 1), (None, 9.83, 0)], 10.003, L, F) == 0.0
    assert coalesce_wait([(10.000, 10.000, 1), (None, 9.5, 0)], 10.010, L, F) == 0.0
    # an upload being fed (a backlog of old frames) does not end the wait for the paced calls...
    upload = (8.0, 10.001, 40)
    assert coalesce_wait([(10.000, 10.000, 1), (None, 9.921, 0), upload], 10.003, L, F) == pytest.approx(0.017)
    # ...is never waited for, and alone (or with calls that fell behind) is stepped at once
    assert coalesce_wait([upload, (9.9, 9.99, 2)], 10.003, L, F) == 0.0
    # an inconsistent reading (one pending, no arrival time) never raises: it took the engine thread
    # down on the H200 (calls now read all three under one lock, Call.pacing)
    assert coalesce_wait([(None, 10.0, 1), (None, 9.921, 0)], 10.003, L, F) == 0.0
    assert coalesce_wait([(None, 10.0, 1), (10.000, 10.000, 1), (None, 9.921, 0)], 10.003, L, F) == pytest.approx(0.017)


def test_duty_wait_rule():
    """duty_wait on made-up times (seconds): the last step started at 10.000 and took 0.030; max_duty 0.75
    allows the next at 10.040, but a paced frame (one pending) never waits past its arrival + cap (0.020
    here); backlogs (more than one pending) neither set the cap nor are a reason to hold."""
    from nemo_duplex.serving.pacing import duty_wait

    last, cap = (10.000, 0.030), 0.020
    assert duty_wait([(10.031, 10.031, 1), (None, 9.99, 0)], 10.032, last, 0.75, cap) == pytest.approx(0.008)
    assert duty_wait([(10.015, 10.015, 1), (None, 9.99, 0)], 10.032, last, 0.75, cap) == pytest.approx(0.003)
    assert duty_wait([(10.031, 10.031, 1)], 10.045, last, 0.75, cap) == 0.0          # past start + T / duty
    assert duty_wait([(10.031, 10.031, 1)], 10.032, last, 0.0, cap) == 0.0           # off
    assert duty_wait([(10.031, 10.031, 1)], 10.032, None, 0.75, cap) == 0.0          # no step yet
    assert duty_wait([(9.5, 10.031, 40), (None, 9.99, 0)], 10.032, last, 0.75, cap) == 0.0  # only a backlog
    assert duty_wait([(9.5, 10.031, 40), (10.031, 10.031, 1)], 10.032, last, 0.75, cap) == pytest.approx(0.008)


def test_duty_hold_waits_for_idle_calls_within_its_bounds(tiny, example_clip):
    """engine.max_duty in the engine's wait: the last step began now and took 60 ms, max_duty 0.3, so the
    next may start 200 ms after it; call a has a frame, call b has none. The wait lasts ~200 ms; it ends
    as soon as b's frame arrives (every live call has one: nothing more to wait for); the cap bounds it
    by a's frame's age; with max_duty 0 there is no wait."""
    frame = example_clip[:1280].numpy()

    def held_for(duty, cap_ms, b_after=None):
        eng = _engine(tiny, max_calls=2, coalesce_ms=0.0, max_duty=duty, duty_hold_cap_ms=cap_ms)
        eng._running = True  # _coalesce's loop runs while the engine does
        a, b = eng.open_call(), eng.open_call()
        eng.tick()  # admits both
        assert a.admitted and b.admitted
        a.append(frame)
        eng._last_step = (time.monotonic(), 0.06)
        if b_after is not None:
            threading.Timer(b_after, lambda: b.append(frame)).start()
        t0 = time.monotonic()
        eng._coalesce()
        return time.monotonic() - t0

    assert 0.17 < held_for(0.3, 1000.0) < 1.0
    assert 0.04 < held_for(0.3, 1000.0, b_after=0.05) < 0.15
    assert 0.07 < held_for(0.3, 100.0) < 0.15
    assert held_for(0.0, 1000.0) < 0.02


def test_step_gap_rule():
    """step_gap on made-up times (seconds; frames every 0.08 s): how long until the next step of paced calls
    is due, what the admission thread fits an admission piece into."""
    from nemo_duplex.serving.pacing import step_gap

    F = 0.08
    assert step_gap([(None, 9.95, 0), (None, 9.96, 0)], 10.0, F) == pytest.approx(0.03)   # a's next frame first
    assert step_gap([(None, 9.95, 0), (10.0, 10.0, 1)], 10.001, F) == 0.0   # b's frame waits for its step
    assert step_gap([(None, 9.95, 0), (8.0, 9.99, 25)], 10.0, F) == pytest.approx(0.03)   # a backlog: not counted
    assert step_gap([(None, 9.91, 0)], 10.0, F) == 0.0                     # due already (late, still in rhythm)
    assert step_gap([(None, 9.83, 0), (None, None, 0)], 10.0, F) == float("inf")   # quiet, or no frame yet
    assert step_gap([], 10.0, F) == float("inf")


def test_admission_pieces_wait_for_a_gap_between_steps(tiny):
    """Admitter._await_gap: with no gap (Engine.step_gap 0: a step under way) a piece waits, looking again
    as each step ends, and starts once the gap fits it; with none it starts after engine.admission_gap_wait_ms;
    with 0 it never waits."""
    from nemo_duplex.serving.admitter import Admitter

    eng = _engine(tiny, admission_thread=True, admission_gap_wait_ms=3000.0)
    gap = [0.0]
    eng.step_gap = lambda: gap[0]
    admitter = Admitter(eng)   # (not started: _await_gap runs on the test's thread)

    def step_ends(after_s: float, then_gap: float) -> None:
        def end():
            gap[0] = then_gap
            with eng.step_ended:
                eng.stats.steps += 1
                eng.step_ended.notify_all()
        threading.Timer(after_s, end).start()

    def waited(estimate: float) -> float:
        t0 = time.monotonic()
        admitter._await_gap(estimate)
        return time.monotonic() - t0

    gap[0] = 0.05
    assert waited(0.02) < 0.05   # the gap fits: at once
    gap[0] = 0.0
    step_ends(0.2, 0.01)   # a step ends, but its gap (10 ms) is short of the piece (20 ms) ...
    step_ends(0.4, 0.05)   # ... the next one's fits
    assert 0.35 < waited(0.02) < 2.0
    assert admitter.pieces == {"gap": 2, "waited": 0}
    gap[0], admitter.gap_wait_s = 0.0, 0.15   # no gap ever: it starts after the bound
    assert 0.14 < waited(0.02) < 1.0 and admitter.pieces == {"gap": 2, "waited": 1}
    admitter.gap_wait_s = 0.0   # engine.admission_gap_wait_ms=0: back to back
    assert waited(0.02) < 0.05 and admitter.pieces == {"gap": 2, "waited": 1}


def test_admission_pieces_run_between_the_live_calls_steps(tiny, example_clip, monkeypatch):
    """engine.admission_gap_wait_ms on a running engine: a live call speaks every 80 ms while a new call's
    prompt is prefilled in 4-token pieces slowed to 25 ms each (12 or more pieces). Each piece starts in a gap
    between the live call's steps where the last one's time fits; back to back, as before, they ran over
    ~300 ms and beside three or four steps. At most one piece may overlap a step (a CPU this busy can
    stretch a piece past its estimate); the admitted call's tokens are those of the same call admitted
    inline."""
    from nemo_duplex.serving import engine as engine_mod

    model, tok, *_ = tiny
    prompt = " ".join(["Please answer briefly and kindly."] * 6)
    clip = example_clip[: 1280 * 6]
    inline = drive(_engine(tiny, prefix_cache_mib=0, prefill_chunk_tokens=4),
                   clip_plans([clip], prompt=prompt, seed=3))[0]
    admission, pieces, steps = engine_mod.admission, [], []

    def slowed(*args, **kwargs):
        inner = admission(*args, **kwargs)
        while True:
            t = time.monotonic()
            time.sleep(0.025)
            try:
                next(inner)
            except StopIteration:
                return
            finally:
                pieces.append((t, time.monotonic()))
            yield
    monkeypatch.setattr(engine_mod, "admission", slowed)
    eng = _engine(tiny, prefix_cache_mib=0, prefill_chunk_tokens=4, admission_thread=True,
                  admission_gap_wait_ms=5000.0)
    step_to_host = eng.step_runner.step_to_host

    def timed(*args, **kwargs):
        t = time.monotonic()
        try:
            return step_to_host(*args, **kwargs)
        finally:
            steps.append((t, time.monotonic()))
    eng.step_runner.step_to_host = timed
    eng.start()
    try:
        live = eng.open_call(CallOptions(seed=1))
        while not live.admitted:
            time.sleep(0.01)
        eng.admitter.first_piece_s = 0.03   # (the estimate the first admission would have left)
        pieces.clear()
        events = CallEvents()
        new = eng.open_call(CallOptions(prompt=prompt, seed=3), on_event=events)
        assert eng.prompt_ids(prompt).numel() >= 44
        new.append(clip.numpy())
        new.end_input()
        for k in range(40):   # 3.2 s of the live call, a frame every 80 ms
            live.append(example_clip[1280 * (k % 60): 1280 * (k % 60 + 1)].numpy())
            time.sleep(0.08)
            if events.ended.is_set() and k >= 10:
                break
        assert events.ended.wait(30)
        live.abort()
    finally:
        eng.stop()
    assert len(pieces) >= 12
    overlapping = [p for p in pieces if any(s0 < p[1] and p[0] < s1 for s0, s1 in steps)]
    assert len(overlapping) <= 1, ([(round(a - pieces[0][0], 3), round(b - pieces[0][0], 3)) for a, b in pieces],
                                   [(round(a - pieces[0][0], 3), round(b - pieces[0][0], 3)) for a, b in steps])
    assert eng.admitter.pieces["gap"] >= 12
    assert [f.text for f in events.frames] == inline.text_tokens.tolist()


def test_backlog_hold_rule():
    """backlog_hold on made-up times (seconds; frames every 0.08 s): paced call p stepped its last frame,
    which arrived at 9.95, so its next is due at 10.03; call u has a backlog of 25 frames."""
    from nemo_duplex.serving.pacing import backlog_hold

    F, p, u = 0.08, (None, 9.95, 0), (8.0, 9.9, 25)
    assert backlog_hold([p, u], 10.000, F, 0.020) == 0.0                      # ends at 10.02: step it now
    assert backlog_hold([p, u], 10.000, F, 0.040) == pytest.approx(0.030)     # would end past 10.03: hold
    assert backlog_hold([p, u], 10.025, F, 0.010) == pytest.approx(0.005)
    assert backlog_hold([(10.0, 10.0, 1), u], 10.001, F, 0.040) == 0.0        # a paced frame is pending
    assert backlog_hold([p], 10.000, F, 0.040) == 0.0                         # no backlog
    assert backlog_hold([u, (None, None, 0)], 10.000, F, 0.040) == 0.0        # no paced call
    assert backlog_hold([(None, 9.9, 0), u], 10.000, F, 0.040) == 0.0         # p's frame is overdue


def test_backlog_hold_in_the_engine(tiny, example_clip):
    """Engine._hold_backlog: call a was stepped, its next frame is due 80 ms after its last arrived; call b
    has a backlog. With a backlog step estimated at 0.5 s (the engine's last step of that many rows) the
    step waits for a's next frame: until it is due (~80 ms), or less when it arrives sooner (30 ms here);
    estimated at 1 ms, or with coalescing off (engine.coalesce_ms = 0), b is stepped at once."""
    frame = example_clip[:1280].numpy()

    def held_for(estimate, a_after=None, coalesce_ms=15.0):
        eng = _engine(tiny, max_calls=2, coalesce_ms=coalesce_ms)
        eng._running = True  # the hold's loop runs while the engine does
        a, b = eng.open_call(), eng.open_call()
        eng.tick()  # admits both
        a.append(frame)
        eng.tick()  # a's frame stepped: a has none pending, its next is due 80 ms after this one arrived
        a.last_ready = time.monotonic()   # (arrived now: however long the step took on this machine)
        b.append(example_clip[: 1280 * 10].numpy())
        eng._step_seconds = {1: estimate}
        if a_after is not None:
            threading.Timer(a_after, lambda: a.append(frame)).start()
        t0 = time.monotonic()
        live = eng._live_calls()
        eng._hold_backlog(live, [c.pacing() for c in live])
        return time.monotonic() - t0

    assert 0.06 < held_for(0.5) < 0.2
    assert 0.02 < held_for(0.5, a_after=0.03) < 0.07
    assert held_for(0.001) < 0.01
    assert held_for(0.5, coalesce_ms=0.0) < 0.01


def test_engine_survives_a_failing_coalesce(tiny, example_clip, monkeypatch):
    """A bug in the coalescing rule costs that step its wait, not the engine thread: the call is still
    stepped and completes."""

    eng = _engine(tiny, max_calls=1, coalesce_ms=15.0)
    broken = {"n": 0}

    def coalesce():
        broken["n"] += 1
        raise TypeError("a coalescing bug")

    monkeypatch.setattr(eng, "_coalesce", coalesce)
    eng.start()
    call = eng.open_call()
    call.append(example_clip[:1280 * 3].numpy())
    call.end_input()
    deadline = time.monotonic() + 60
    while not call.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert call.closed and call.frames_out == 3 and broken["n"] > 0 and eng._thread.is_alive()
    eng.stop()


def test_engine_runs_all_greedy_batches_without_sampling(tiny, example_clip):
    """The engine tells the step runner when every call of a batch is greedy (StepRunner then replays its
    greedy-only graphs, engine.greedy_graphs); a batch with one sampling call takes the general step."""
    from nemo_duplex.models.config import SamplingParams
    from nemo_duplex.serving.calls import CallOptions

    eng = _engine(tiny, max_calls=3)
    flags = []
    runner = eng.step_runner

    class Spy(HostStepper):   # the real runner, recording what the engine asked for
        host_fields = runner.host_fields

        def __call__(self, slots, audio, forced, sampling=True):
            flags.append((len(slots), sampling))
            return runner(slots, audio, forced, sampling)
    eng.step_runner = Spy()
    frame = example_clip[:1280].numpy()
    a, b = eng.open_call(), eng.open_call()
    eng.tick()
    a.append(frame)
    b.append(frame)
    eng.tick()
    c = eng.open_call(CallOptions(sampling=SamplingParams(temperature=0.7, top_p=0.9)))
    eng.tick()
    for call in (a, b, c):
        call.append(frame)
    eng.tick()
    assert flags == [(2, False), (3, True)]
    eng.step_runner = runner



def test_admission_thread_keeps_live_calls_stepping(tiny, example_clip, monkeypatch):
    """engine.admission_thread=true (an engine on its own thread): a new call whose admission takes
    0.6 s (slowed here) does not hold the live call, which is stepped all the while; the admitted call then
    gives the tokens of the same call admitted inline (serving/drive.py)."""
    model, tok, *_ = tiny
    clip = example_clip[: 1280 * 10]
    inline = drive(_engine(tiny, prefix_cache_mib=0), clip_plans([clip], prompt="Be brief.", seed=3))[0]

    _hold_admissions(monkeypatch, lambda: time.sleep(0.6))
    eng = _engine(tiny, prefix_cache_mib=0, admission_thread=True)
    eng.start()
    try:
        live_frames = []
        live = eng.open_call(CallOptions(seed=1), on_event=lambda ev: isinstance(ev, FrameEvent) and
                             live_frames.append(time.monotonic()))
        deadline = time.monotonic() + 10                   # admitted (slowly)
        while not live.admitted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert live.admitted
        events, ended = [], threading.Event()

        def on_event(ev):
            events.append(ev)
            if isinstance(ev, EndedEvent):
                ended.set()
        t0 = time.monotonic()
        new = eng.open_call(CallOptions(prompt="Be brief.", seed=3), on_event=on_event)
        new.append(clip.numpy())
        new.end_input()
        for k in range(8):                                 # the live call speaks every 80 ms meanwhile
            live.append(example_clip[1280 * k: 1280 * (k + 1)].numpy())
            time.sleep(0.08)
        assert ended.wait(30)
        stepped_during = [t for t in live_frames if t0 < t < t0 + 0.6]
        assert len(stepped_during) >= 4, (len(live_frames), [round(t - t0, 2) for t in live_frames])
        frames = [e for e in events if isinstance(e, FrameEvent)]
        assert [f.text for f in frames] == inline.text_tokens.tolist()
        live.abort()
    finally:
        eng.stop()


def test_a_call_ended_while_the_thread_admits_it_keeps_its_slot_until_then(tiny, monkeypatch):
    """engine.admission_thread: a call aborted while the thread writes its slot's rows gives the slot back
    only once the thread is done with it; given back at once, the next call could be admitted into the same
    rows by the thread while the first admission still wrote them."""
    writing = _hold_admissions(monkeypatch, lambda: time.sleep(0.5))
    eng = _engine(tiny, max_calls=1, prefix_cache_mib=0, admission_thread=True)
    eng.start()
    try:
        ended = threading.Event()
        a = eng.open_call(on_event=lambda ev: isinstance(ev, EndedEvent) and ended.set())
        assert writing.wait(10)
        a.abort("aborted", "hung up during admission")
        assert ended.wait(10)                     # the call ends at once for its client ...
        assert eng.slots.in_use == 1              # ... while its slot is still the thread's
        with pytest.raises(EngineBusy):
            eng.open_call()
        deadline = time.monotonic() + 10
        while eng.slots.in_use and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.slots.in_use == 0
        eng.open_call().abort()
    finally:
        eng.stop()


def test_a_call_the_admission_thread_never_finishes_ends_with_the_limit_named(tiny, monkeypatch):
    """engine.max_admission_s: an admission that never returns (a hung thread) ends its call, and the call
    queued behind it, with an error naming the setting, instead of leaving their clients waiting; the
    engine reports the stall (admission_stalled_s, what /health shows) and the slots stay the thread's until
    it is done; then they come back and a new call is admitted."""
    release = threading.Event()
    _hold_admissions(monkeypatch, lambda: release.wait(30))
    eng = _engine(tiny, max_calls=2, prefix_cache_mib=0, admission_thread=True, max_admission_s=0.5)
    eng.start()
    try:
        recorders = [CallEvents(), CallEvents()]
        calls = [eng.open_call(on_event=r) for r in recorders]
        calls[0].append(np.zeros(1280 * 3, dtype=np.float32))
        t0 = time.monotonic()
        assert all(r.ended.wait(10) for r in recorders)
        assert 0.5 <= time.monotonic() - t0 < 5.0
        for r in recorders:
            assert r.endings == [("error", "the call was not admitted within engine.max_admission_s = 0.5 s")]
        deadline = time.monotonic() + 5   # (the thread took the first call a moment after it was submitted)
        while eng.admission_stalled_s == 0.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.admission_stalled_s > 0.5
        assert eng.slots.in_use == 2              # the thread still holds both slots
        release.set()
        deadline = time.monotonic() + 10
        while (eng.slots.in_use or eng.admission_stalled_s) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.slots.in_use == 0 and eng.admission_stalled_s == 0.0
        # (released: a new call's admission holds no longer)
        last = CallEvents()
        eng.open_call(on_event=last).end_input()
        assert last.ended.wait(10)
    finally:
        release.set()
        eng.stop()


def test_a_step_under_way_past_max_step_s_marks_the_engine_stalled(tiny, example_clip):
    """engine.max_step_s: while a step has been under way longer (here a runner that takes 2 s once: a
    stand-in for a kernel that never finishes), engine_stalled_s says for how long (what /health and the
    replicas' health check read); 0 before, and again once it is done."""

    eng = _engine(tiny, max_step_s=0.3)
    runner, slow, entered = eng.step_runner, [True], threading.Event()

    class SlowOnce(HostStepper):
        host_fields = runner.host_fields

        def __call__(self, *args, **kwargs):
            if slow.pop() if slow else False:
                entered.set()
                time.sleep(2.0)
            return runner(*args, **kwargs)

    eng.prepare()   # (captures with the real runner: a no-op on the CPU)
    eng.step_runner = SlowOnce()
    eng.start()
    try:
        assert eng.engine_stalled_s == 0.0
        call = eng.open_call()
        call.append(example_clip[:1280].numpy())
        assert entered.wait(10)
        deadline = time.monotonic() + 5
        while eng.engine_stalled_s == 0.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 0.3 < eng.engine_stalled_s < 2.5
        # the stall clears as the step returns; the engine thread counts the call's frame a moment later
        while (eng.engine_stalled_s or call.frames_stepped < 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.engine_stalled_s == 0.0 and call.frames_stepped == 1
        call.abort()
    finally:
        eng.stop()


def test_an_inline_admission_piece_past_max_step_s_marks_the_engine_stalled(tiny, monkeypatch):
    """engine.admission_thread=false: an admission piece runs on the engine thread between steps, so one that
    takes too long (here 2 s) holds the engine thread like a step that does, and says so the same way."""
    entered = _hold_admissions(monkeypatch, lambda: time.sleep(2.0))
    eng = _engine(tiny, prefix_cache_mib=0, admission_thread=False, max_step_s=0.3)
    eng.start()
    try:
        call = eng.open_call()
        assert entered.wait(10)
        deadline = time.monotonic() + 5
        while eng.engine_stalled_s == 0.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 0.3 < eng.engine_stalled_s < 2.5
        # (the piece marks the call admitted a moment before the engine thread clears its stall)
        while (not call.admitted or eng.engine_stalled_s) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert call.admitted and eng.engine_stalled_s == 0.0
        call.abort()
    finally:
        eng.stop()


def test_admission_thread_settings_without_the_thread_are_named_unused(tiny, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="nemo_duplex.serving.engine"):
        _engine(tiny, admission_thread=False, max_admission_s=5.0, admission_gap_wait_ms=10.0)
        _engine(tiny, admission_thread=True, max_admission_s=5.0, admission_gap_wait_ms=10.0)
    unused = [r.getMessage() for r in caplog.records if "is unused" in r.getMessage()]
    assert unused == [f"engine.{key} is unused: engine.admission_thread=false admits on the engine thread, "
                      "between steps" for key in ("max_admission_s=5", "admission_gap_wait_ms=10")]


@pytest.mark.parametrize("bad", [{"admission_pieces_per_tick": 0}, {"prefill_chunk_tokens": -1},
                                 {"max_admission_s": 0.0}, {"max_step_s": -1.0}, {"admission_gap_wait_ms": -1.0},
                                 {"admission_gap_wait_ms": float("inf")}])
def test_admission_settings_that_could_never_admit_are_refused(tiny, bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        _engine(tiny, **bad)


@pytest.mark.gpu
def test_admission_thread_on_cuda_equals_inline_admission(tiny, example_clip):
    """On CUDA the admission thread prefills on a low-priority stream of its own while the engine thread
    replays the captured steps on a high-priority one (Engine._step_stream). A missed ordering between them
    (a step reading a slot before its admission's kernels are done, an admission writing rows a step still
    reads) would show as tokens or codes that differ from the same calls admitted inline: 2 live calls, then
    4 calls with prompts of their own opened while they are stepped; one capture bucket (8 rows) on both
    sides, so every row runs the same kernels whatever shares its step; fp32 tiny model, bit for bit."""
    import copy

    model = copy.deepcopy(tiny[0]).to("cuda")
    tok = tiny[1]
    clips = _clips(example_clip, 6, 16, seed=4)
    prompts = [None, None] + [f"Answer in {w} words." for w in ("two", "three", "four", "five")]
    kw = dict(max_calls=8, max_call_s=20.0, capture_buckets=[8], graphs=True, prefix_cache_mib=0)
    inline = build_engine(model, tok, EngineConfig(**kw, admission_thread=False))   # driven tick by tick: inline
    want = [drive(inline, clip_plans([c], prompt=p, seed=10 + i))[0] for i, (c, p) in enumerate(zip(clips, prompts))]
    del inline

    eng = build_engine(model, tok, EngineConfig(**kw, admission_thread=True))
    eng.start()
    try:
        recorders = [CallEvents() for _ in clips]
        calls = [eng.open_call(CallOptions(prompt=prompts[i], seed=10 + i), on_event=recorders[i]) for i in (0, 1)]
        for k in range(16):
            for c, clip in zip(calls, clips[:2]):
                c.append(clip[1280 * k: 1280 * (k + 1)].numpy())
            if k == 4:   # the live calls are being stepped: the others open now, their audio whole
                for i in range(2, 6):
                    c = eng.open_call(CallOptions(prompt=prompts[i], seed=10 + i), on_event=recorders[i])
                    c.append(clips[i].numpy())
                    c.end_input()
            time.sleep(0.02)
        for c in calls:
            c.end_input()
        assert all(r.ended.wait(60) for r in recorders)
    finally:
        eng.stop()
    for i, r in enumerate(recorders):
        assert [reason for reason, _ in r.endings] == ["completed"], (i, r.endings)
        frames = r.frames
        assert [f.text for f in frames] == want[i].text_tokens.tolist(), i
        assert torch.equal(torch.from_numpy(np.stack([f.codes for f in frames])), want[i].codes), i

