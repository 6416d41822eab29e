"""Admissions from the prefix cache, several calls at once (frame_step.restore_admissions, the admission
thread's bursts: serving/admitter.py). Tiny model, fp32, on the CPU (one check on CUDA too)."""
import copy
import threading
import time

import pytest
import torch

from nemo_duplex.models.config import SamplingParams
from nemo_duplex.serving import engine as engine_mod
from nemo_duplex.serving.calls import CallOptions
from nemo_duplex.serving.drive import clip_plans, drive
from nemo_duplex.serving.engine import build_engine
from nemo_duplex.serving.frame_step import admission, admission_key, restore_admissions
from nemo_duplex.serving.pages import KVPages
from nemo_duplex.serving.state import KVPageCounts, PrefixCache, allocate_call_state, state_tensors
from nemo_duplex.settings import EngineConfig
from tests.call_events import CallEvents
from tests.dispatched_ops import DispatchedOps

PROMPT = "Answer in one short sentence."
SLOTS = [4, 0, 2]    # not in order, and slot 1, slot 3 and the sink are left alone
SAMPLINGS = [SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1),
             SamplingParams(), SamplingParams(temperature=1.0)]


def _state(model, paged: bool, prompt_tokens: int, device: str = "cpu"):
    """A state of 5 calls whose every pool holds seeded noise (so a row left unreset shows), paged or not;
    paged, SLOTS hold the pages their admission writes (as serving/pages.py gives them)."""
    kv_pages = KVPageCounts(4, 40, 40) if paged else None
    st = allocate_call_state(model, 5, 12, torch.device(device), 16, kv_pages)
    if paged:
        pages = KVPages(st, model.cfg.prompt_frames, 16)
        for slot in SLOTS:
            assert pages.commit(slot, prompt_tokens, model.cfg.prompt_frames)
            pages.grow(slot, prompt_tokens, model.cfg.prompt_frames)
    g = torch.Generator().manual_seed(5)
    for name, t in state_tensors(st):
        if name.endswith("pages"):
            continue
        if t.dtype == torch.bool:
            t.copy_(torch.rand(t.shape, generator=g) < 0.5)
        elif t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        else:
            t.copy_(torch.randint(0, 7, t.shape, generator=g))
    return st


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("paged", [False, True])
def test_calls_restored_together_equal_calls_admitted_fresh_one_by_one(tiny, paged, device):
    """Three calls with one cached prompt restored at once leave every pool as the full admission (prompt
    prefill and talker warm-up, no cache) of each call one by one does, bit for bit: the rows of the three
    slots, and every other row untouched."""
    model, tok, *_ = tiny
    model = copy.deepcopy(model).to(device) if device != "cpu" else model
    ids = model.prompt_ids(tok, PROMPT).to(device)
    seeds = [11, 2**40, 0]

    fresh = _state(model, paged, ids.numel(), device)
    for slot, seed, sampling in zip(SLOTS, seeds, SAMPLINGS):
        for _ in admission(model, fresh, slot, ids, seed, sampling):
            pass

    cache, scratch = PrefixCache(1 << 30), _state(model, paged, ids.numel(), device)
    for _ in range(2):   # the doorkeeper: cached on the second admission (snapshot from pools paged or not)
        for _ in admission(model, scratch, SLOTS[0], ids, 0, SamplingParams(), None, cache):
            pass
    key = admission_key(model, ids, None)
    assert key in cache

    together = _state(model, paged, ids.numel(), device)
    restore_admissions(model, together, SLOTS, cache.get(key, calls=3), seeds, SAMPLINGS)
    assert cache.hits == 3
    differ = [name for (name, a), (_, b) in zip(state_tensors(fresh), state_tensors(together)) if not torch.equal(a, b)]
    assert differ == []


def test_a_restore_runs_the_same_ops_for_one_call_as_for_five(tiny):
    """What made a burst of callers slow to admit was a launch count per call: restoring five calls must run
    the ops one call's does, no more (counted at torch's dispatcher, views left out: how a value of one row is
    broadcast takes a view more or less)."""
    model, tok, *_ = tiny
    st = allocate_call_state(model, 6, 12, torch.device("cpu"), 16)
    cache = PrefixCache(1 << 30)
    ids = model.prompt_ids(tok, PROMPT)
    for _ in range(2):
        for _ in admission(model, st, 5, ids, 0, SamplingParams(), None, cache):
            pass
    snap = cache.get(admission_key(model, ids, None))
    counts = []
    for slots in ([1], [0, 1, 2, 3, 4]):
        with DispatchedOps() as count:
            restore_admissions(model, st, slots, snap, [7] * len(slots), [SamplingParams()] * len(slots))
        counts.append(count.ops)
    assert counts[0] == counts[1] and len(counts[0]) > 20


def test_calls_queued_behind_admissions_are_restored_in_one_go_first(tiny, example_clip, monkeypatch):
    """The admission thread: while it prefills one call's fresh prompt (held here), another fresh prompt and then
    five calls with a cached prompt queue behind it; then one restore admits all five (one call of
    restore_admissions, five slots, five hits) before the second fresh prompt's admission, and each gives
    the tokens and codes of the same call admitted inline by itself."""
    model, tok, *_ = tiny
    clip = example_clip[: 1280 * 6]
    inline = drive(build_engine(model, tok, EngineConfig(max_calls=2, max_call_s=20.0, prefix_cache_mib=0)),
                   clip_plans([clip], prompt=PROMPT, seed=4))[0]

    eng = build_engine(model, tok, EngineConfig(max_calls=8, max_call_s=20.0, admission_thread=True))
    restores = []

    def recording_restore(model_, st, slots, *args):
        restores.append(list(slots))
        restore_admissions(model_, st, slots, *args)

    monkeypatch.setattr(engine_mod, "restore_admissions", recording_restore)
    gates, entered = [threading.Event(), threading.Event()], []   # one per fresh prompt's admission
    eng.start()
    try:
        def run_one(prompt):   # one call through, until it ends
            recorder = CallEvents()
            eng.open_call(CallOptions(prompt=prompt, seed=4), on_event=recorder).end_input()
            assert recorder.ended.wait(30) and recorder.endings == [("completed", "")]
        run_one(PROMPT)
        run_one(PROMPT)   # cached now
        assert restores == [] and admission_key(model, eng.prompt_ids(PROMPT), None) in eng.prefix_cache

        admission_fn = engine_mod.admission

        def held(*args, **kwargs):
            i = len(entered)
            entered.append(i)
            assert gates[i].wait(30)
            yield from admission_fn(*args, **kwargs)
        monkeypatch.setattr(engine_mod, "admission", held)
        blockers = [eng.open_call(CallOptions(prompt=f"A prompt of its own, never seen, number {i}.", seed=1))
                    for i in range(2)]
        deadline = time.monotonic() + 10
        while not entered and time.monotonic() < deadline:
            time.sleep(0.01)
        assert entered == [0]

        recorders = [CallEvents() for _ in range(5)]
        calls = [eng.open_call(CallOptions(prompt=PROMPT, seed=4), on_event=r) for r in recorders]
        submitted = [blockers[1]] + calls           # the second fresh prompt, then the five
        deadline = time.monotonic() + 10
        while not all(c.in_admission for c in submitted) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(c.in_admission for c in submitted) and entered == [0]
        hits = eng.prefix_cache.hits
        gates[0].set()
        for call in calls:
            call.append(clip.numpy())
            call.end_input()
        assert all(r.ended.wait(30) for r in recorders)   # all five served while the second fresh prompt is held
        assert entered == [0, 1] and not gates[1].is_set()
        assert restores == [[c.slot for c in calls]] and eng.prefix_cache.hits == hits + 5
        for r in recorders:
            assert [e.text for e in r.frames] == inline.text_tokens.tolist()
            assert torch.equal(torch.stack([torch.as_tensor(e.codes) for e in r.frames]), inline.codes)
        gates[1].set()
        for blocker in blockers:
            blocker.abort()
    finally:
        for gate in gates:
            gate.set()
        eng.stop()


def test_calls_opened_in_one_tick_are_restored_together_inline(tiny, example_clip, monkeypatch):
    """engine.admission_thread=false (here an engine driven tick by tick): four calls with a cached prompt
    opened in one tick are restored by one restore_admissions, before the step, and each gives the tokens
    and codes of the same call admitted without a prefix cache."""
    model, tok, *_ = tiny
    clip = example_clip[: 1280 * 6]
    plans = clip_plans([clip] * 4, prompt=PROMPT, seed=4)
    reference = drive(build_engine(model, tok, EngineConfig(max_calls=4, max_call_s=20.0, prefix_cache_mib=0)), plans)

    eng = build_engine(model, tok, EngineConfig(max_calls=4, max_call_s=20.0))
    for _ in range(2):
        drive(eng, clip_plans([clip[:1280]], prompt=PROMPT))
    restores = []

    def recording_restore(model_, st, slots, *args):
        restores.append(len(slots))
        restore_admissions(model_, st, slots, *args)

    monkeypatch.setattr(engine_mod, "restore_admissions", recording_restore)
    hits = eng.prefix_cache.hits
    together = drive(eng, plans)
    assert restores == [4] and eng.prefix_cache.hits == hits + 4
    for r, ref in zip(together, reference):
        assert torch.equal(r.text_tokens, ref.text_tokens) and torch.equal(r.codes, ref.codes)


@pytest.mark.parametrize("admission_thread", [True, False])
def test_a_failed_restore_ends_its_calls_and_the_next_one_is_admitted(tiny, monkeypatch, admission_thread):
    """A restore that raises (here a stand-in that fails once) ends every call of its group with the error;
    their slots come back, and the next call with the same prompt is restored and completes."""
    model, tok, *_ = tiny
    eng = build_engine(model, tok, EngineConfig(max_calls=3, max_call_s=20.0, admission_thread=admission_thread))
    failures = [RuntimeError("restore failed")]

    def failing_once(*args):
        if failures:
            raise failures.pop()
        restore_admissions(*args)

    monkeypatch.setattr(engine_mod, "restore_admissions", failing_once)
    eng.start()
    try:
        def open_calls(n):
            recorders = [CallEvents() for _ in range(n)]
            for r in recorders:
                eng.open_call(CallOptions(prompt=PROMPT), on_event=r).end_input()
            assert all(r.ended.wait(30) for r in recorders)
            return [r.endings for r in recorders]
        assert open_calls(1) == open_calls(1) == [[("completed", "")]]   # the second one cached the prompt
        failed = open_calls(3)
        assert ("error", "restore failed") in [r[0] for r in failed] and not failures
        assert all(r[0] in (("error", "restore failed"), ("completed", "")) for r in failed)
        deadline = time.monotonic() + 10
        while eng.slots.in_use and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.slots.in_use == 0
        assert open_calls(2) == [[("completed", "")]] * 2
    finally:
        eng.stop()
