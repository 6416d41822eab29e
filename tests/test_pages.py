"""KV pages (serving/pages.py): the admission rule on a tiny pool, pages taken as calls grow and returned when
they end, a call's own limit, and the paged engine giving the unpaged engine's tokens and codes bit for bit.
Tiny model, CPU, fp32."""
import contextlib

import numpy as np
import pytest
import torch

from nemo_duplex.server.metrics import ServerMetrics
from nemo_duplex.serving.calls import CallLimitInvalid, CallOptions, EndedEvent, EngineBusy
from nemo_duplex.serving.drive import clip_plans, drive
from nemo_duplex.serving.engine import Engine, build_engine
from nemo_duplex.serving.frame_step import special_ids
from nemo_duplex.serving.memory import GiB, kv_bytes_per_position, kv_pages_per_call
from nemo_duplex.serving.pages import KVPages
from nemo_duplex.serving.runner import engine_runner
from nemo_duplex.serving.state import KVPageCounts, allocate_call_state
from nemo_duplex.settings import EngineConfig
from tests.dispatched_ops import DispatchedOps


def _pool_gib(cfg, calls: float, max_call_s: float, prompt_tokens: int, page_len: int) -> float:
    """engine.kv_pool_gib that holds `calls` calls of max_call_s (kv_page_counts' arithmetic), a hair more
    so that the floor of its page counts lands on whole calls."""
    llm_call, talker_call = kv_pages_per_call(cfg, max_call_s, prompt_tokens, page_len)
    llm_position, talker_position = kv_bytes_per_position(cfg)
    return (calls + 1e-6) * page_len * (llm_call * llm_position + talker_call * talker_position) / GiB


def test_the_rule_refuses_the_call_that_could_overflow(tiny):
    """Commitments, not pages in use, decide: 10 LLM and 6 talker pages; a call of 9 / 5 pages fits once,
    a second is refused while the first lives (though the first has taken no page yet), fits once it is
    released. Pages come from the free list as the call grows, never past its commitment, both talker
    streams' tables name them, and a released slot's tables name the sink again."""
    model, *_ = tiny
    st = allocate_call_state(model, 2, 20, torch.device("cpu"), 16, KVPageCounts(4, 10, 6))
    pages = KVPages(st, model.cfg.prompt_frames, 16)
    assert pages.commit(0, 33, 17)          # 9 and 5 pages
    assert not pages.commit(1, 5, 5)         # 2 LLM pages: only 1 uncommitted
    assert pages.usage()["llm_pages_free"] == 10   # nothing taken yet: the refusal is by commitment
    pages.trim(0, 20)                        # the prompt is known: 5 pages
    assert pages.commit(1, 5, 4)             # 2 and 1 now fit
    pages.grow(0, 9, 6)                      # 3 LLM pages, 2 talker pages
    pages.grow(0, 400, 400)                  # capped at the commitment: 5 and 5
    llm_row, cond, uncond = st.llm.pages[0], st.talker.pages[0], st.talker.pages[3]   # 3 slots: sink is 2
    assert len(set(llm_row[:5].tolist())) == 5 and (llm_row[:5] < 10).all()
    assert (cond[:5] < 6).all() and torch.equal(uncond[:5], cond[:5] + 7)   # stream 1's pages follow stream 0's
    assert pages.usage() == {"llm_pages": 10, "llm_pages_free": 5, "llm_pages_uncommitted": 3, "talker_pages": 6,
                             "talker_pages_free": 1, "talker_pages_uncommitted": 0}
    pages.release(0)
    assert (st.llm.pages[0] == 10).all() and (st.talker.pages[0] == 6).all() and (st.talker.pages[3] == 13).all()
    assert pages.usage()["llm_pages_uncommitted"] == 8 and pages.usage()["talker_pages_free"] == 6
    with pytest.raises(ValueError, match="page table"):
        pages.commit(0, 10_000, 5)


def test_a_steps_new_pages_are_written_in_one_write_per_table(tiny):
    """KVPages.writes_together (the engine's step): three calls each taking new pages of both pools write
    each table once (one index_put each, counted at torch's dispatcher), and leave the tables exactly as the
    same grows made one by one."""
    model, *_ = tiny
    tables, writes = [], []
    for together in (False, True):
        st = allocate_call_state(model, 3, 40, torch.device("cpu"), 16, KVPageCounts(4, 40, 40))
        pages = KVPages(st, model.cfg.prompt_frames, 16)
        for slot in range(3):
            assert pages.commit(slot, 32, 32)
            pages.grow(slot, 4, 4)
        with DispatchedOps() as ops, pages.writes_together() if together else contextlib.nullcontext():
            for slot in (2, 0, 1):
                pages.grow(slot, 12 + 4 * slot, 30)      # 2-4 more LLM pages, 7 more talker pages each
        tables.append((st.llm.pages.clone(), st.talker.pages.clone()))
        writes.append(sum("index_put" in op for op in ops.ops))
    assert torch.equal(tables[0][0], tables[1][0]) and torch.equal(tables[0][1], tables[1][1])
    assert (tables[1][0][:3, 1:3] < 40).all() and (tables[1][1][:3, 1:8] < 40).all()   # pages were taken
    assert writes == [6, 2]


def _paged_engine(tiny, calls: float, **kw):
    model, tok, *_ = tiny
    cfg = EngineConfig(**{"max_calls": 4, "max_call_s": 2.0, "kv_page_len": 16, "max_prompt_tokens": 32, **kw})
    cfg.kv_pool_gib = _pool_gib(model.cfg, calls, cfg.max_call_s, cfg.max_prompt_tokens, cfg.kv_page_len)
    return build_engine(model, tok, cfg)


def test_engine_admits_by_pages(tiny):
    """A pool for 2.75 calls of the engine's 2 s limit behind 4 slots: two calls open, a third of 2 s is
    refused with EngineBusy naming engine.kv_pool_gib though a slot is free, one that says it lasts 0.4 s fits
    (its pages: the prompt's 32 tokens and 5 frames), a second such is refused, and the 2 s call fits once a
    call ends. A call's own limit above the engine's, or not above 0, is refused."""
    eng = _paged_engine(tiny, 2.75)
    a, b = eng.open_call(), eng.open_call()
    with pytest.raises(EngineBusy, match="engine.kv_pool_gib"):
        eng.open_call()
    assert eng.active_calls == 2                        # the refused call's slot went back
    short = eng.open_call(CallOptions(max_call_s=0.4))
    with pytest.raises(EngineBusy, match="a call of up to 0.4 s"):
        eng.open_call(CallOptions(max_call_s=0.4))
    metrics = ServerMetrics(deadline_s=0.1)   # /metrics shows what admission decides by
    metrics.sample_engine(eng, sessions=3)
    text = metrics.render().decode()
    for key, value in eng.pages.usage().items():
        pool, _, state = key.partition("_pages")
        assert f'duplex_kv_pages{{pool="{pool}",state="{state.lstrip("_") or "total"}"}} {float(value)}' in text
    assert 'duplex_kv_pages{pool="llm",state="uncommitted"} 0.0' in text
    a.abort()
    eng.tick()
    c = eng.open_call()
    for bad in (2.5, 0.0, -1.0):
        with pytest.raises(CallLimitInvalid, match="engine.max_call_s"):
            eng.open_call(CallOptions(max_call_s=bad))
    for call in (b, short, c):
        call.abort()
    eng.tick()
    assert eng.active_calls == 0
    assert eng.pages.usage()["llm_pages_free"] == eng.pages.llm.num_pages
    assert eng.pages.usage()["talker_pages_uncommitted"] == eng.pages.talker.num_pages


def test_calls_that_fill_the_pool_run_to_their_limit(tiny, example_clip):
    """Two calls of the whole 2 s limit in a pool for exactly two (pages of 16 positions, so each call takes
    pages as it grows, prompt pages first) complete every frame, and a call past its own 0.4 s ends "limit"
    naming its max_call_s."""
    eng = _paged_engine(tiny, 2.0)
    clip = example_clip[: 1280 * 25]
    out = drive(eng, clip_plans([clip, clip], prompt="Be brief.", seed=2))
    assert [o.text_tokens.shape[0] for o in out] == [25, 25]
    assert eng.pages.usage()["llm_pages_free"] == eng.pages.llm.num_pages
    ended = []
    call = eng.open_call(CallOptions(max_call_s=0.4), on_event=lambda ev: ended.append(ev)
                         if isinstance(ev, EndedEvent) else None)
    call.append(np.zeros(1280 * 6, dtype=np.float32))
    for _ in range(12):
        eng.tick()
    assert ended and ended[0].reason == "limit" and "its own max_call_s = 0.4 s" in ended[0].message


def test_paged_engine_equals_unpaged(tiny, example_clip):
    """Pages of 16 positions (the smallest), staggered calls with a prompt (the second admission of it restored from the
    prefix cache, through the page tables) and an upload: the tokens and codes the unpaged pools give, bit
    for bit, and the PCM within one int16 step."""
    model, tok, *_ = tiny
    cfg = EngineConfig(max_calls=3, max_call_s=2.0, kv_page_len=16, max_prompt_tokens=32)
    clips = [example_clip[i * 3000: i * 3000 + 1280 * 14] for i in range(3)]
    plans = lambda: clip_plans(clips, offsets=[0, 3, 5], prompt="Be brief.", uploads=[False, False, True],  # noqa: E731
                               seed=7)
    paged = build_engine(model, tok, cfg)
    assert paged.state.llm.pages is not None and paged.state.llm.k.shape[3] == 16
    max_frames = paged.state.max_frames
    state = allocate_call_state(model, cfg.max_calls, max_frames, torch.device("cpu"), cfg.max_prompt_tokens)
    flat = Engine(model, tok, cfg, state, engine_runner(model, state, special_ids(model, torch.device("cpu")), cfg))
    assert flat.pages is None
    got, want = drive(paged, plans()), drive(flat, plans())
    assert paged.prefix_cache.hits >= 1 and flat.prefix_cache.hits >= 1
    for g, w in zip(got, want):
        assert torch.equal(g.text_tokens, w.text_tokens) and torch.equal(g.codes, w.codes)
        assert (g.wav - w.wav).abs().max() < 1 / 32768


def test_fp8_talker_kv_engine(tiny, example_clip):
    """`model.dtype.talker_kv: fp8`: the talker's pools (paged) hold float8 e4m3, the memory plan counts a
    byte per element (a quarter of fp32's), and the engine serves staggered calls with a prompt and an
    upload to their end with the fp32 pools' text bit for bit (the talker never feeds the LLM) and codes
    from every frame."""
    import copy
    import dataclasses

    model, tok, *_ = tiny
    fp8_model = copy.copy(model)   # the same weights; only the config's dtype of the talker's pools differs
    fp8_model.cfg = dataclasses.replace(model.cfg, dtype=dataclasses.replace(model.cfg.dtype, talker_kv="fp8"))
    assert kv_bytes_per_position(fp8_model.cfg)[1] * 4 == kv_bytes_per_position(model.cfg)[1]
    assert kv_bytes_per_position(fp8_model.cfg)[0] == kv_bytes_per_position(model.cfg)[0]
    cfg = EngineConfig(max_calls=3, max_call_s=2.0, kv_page_len=16, max_prompt_tokens=32)
    clips = [example_clip[i * 3000: i * 3000 + 1280 * 14] for i in range(3)]
    plans = lambda: clip_plans(clips, offsets=[0, 3, 5], prompt="Be brief.", uploads=[False, False, True],  # noqa: E731
                               seed=7)
    narrow, wide = build_engine(fp8_model, tok, cfg), build_engine(model, tok, cfg)
    assert narrow.state.talker.k.dtype == torch.float8_e4m3fn and wide.state.talker.k.dtype == torch.float32
    assert narrow.state.llm.k.dtype == torch.float32
    got, want = drive(narrow, plans()), drive(wide, plans())
    for g, w in zip(got, want):
        assert torch.equal(g.text_tokens, w.text_tokens)
        assert g.codes.shape == w.codes.shape and torch.isfinite(g.wav).all()
    assert narrow.state.talker.k.float().abs().sum() > 0   # the pools were written
