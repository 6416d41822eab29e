"""KV pages: which pages of the LLM's and the talker's KV pools each call holds, and what it may still take.

The rule (engine.kv_pool_gib): a call is admitted only if the pages it could ever need fit beside what
the live calls could still need. At open_call it commits pages for its whole limit (its own max_call_s,
else engine.max_call_s; the LLM's for engine.max_prompt_tokens, trimmed to its real prompt at admission);
the pages themselves are taken as the call grows (a page of page_len positions before the step that first
writes into it) and come back, with the commitment, when it ends. So a live call never runs out of pages
mid-call, and the call that could overflow is the one refused, at open_call, with EngineBusy naming the
pool. Pages a call has committed but not yet taken are no one else's: the pool is never overbooked.

Table entries a call has not been given name the sink page, so a stray address stays inside the pool; a
slot's entries go back to the sink when its call ends. The tables are device tensors the captured step
reads; they are written here by the engine thread on its stream, before the step or admission that needs
them (a page covers page_len frames, 5 s at 64; a step's new pages in one write per table).
"""
from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nemo_duplex.models.gemma import talker_pool_page
from nemo_duplex.serving.memory import kv_page_counts
from nemo_duplex.serving.state import CallState, allocate_call_state

if TYPE_CHECKING:
    from nemo_duplex.serving.calls import Call


@dataclass
class _Pool:
    """One pool's free pages and the pages committed but not yet taken."""
    num_pages: int
    free: list[int] = field(init=False)   # popped from the end: page 0 first
    promised: int = 0     # committed to live calls and not yet taken

    def __post_init__(self):
        self.free = list(range(self.num_pages - 1, -1, -1))

    @property
    def uncommitted(self) -> int:
        return len(self.free) - self.promised


@dataclass
class _Claim:
    """A slot's pages and commitments: how many pages of each pool it may hold in all."""
    llm_limit: int
    talker_limit: int
    llm: list[int] = field(default_factory=list)
    talker: list[int] = field(default_factory=list)


class KVPages:
    """The pages of `state`'s paged KV pools (state.allocate_call_state with kv_pages) and the calls' claims."""

    def __init__(self, state: CallState, prompt_frames: int, max_prompt_tokens: int):
        llm, tk = state.llm, state.talker
        self.prompt_frames, self.max_prompt_tokens = prompt_frames, max_prompt_tokens
        assert llm.pages is not None and tk.pages is not None, "the KV pools are not paged"
        self.page_len = llm.k.shape[3]
        self.llm = _Pool(llm.k.shape[1] - 1)            # the last page is the sink
        self.talker = _Pool(tk.k.shape[2] - 1)
        self.llm_table, self.talker_table = llm.pages, tk.pages
        self.slots = state.max_calls + 1                 # the talker table's rows: stream * slots + slot
        self.max_pages = (llm.pages.shape[1], tk.pages.shape[1])
        self._claims: dict[int, _Claim] = {}
        self._lock = threading.Lock()
        self._deferred: tuple[list, list] | None = None   # table writes held by writes_together

    def pages_for(self, positions: int) -> int:
        return math.ceil(positions / self.page_len)

    # ---- a call's pages (serving/engine.py) ---------------------------------------------------------
    def open_call(self, slot: int, max_frames: int) -> bool:
        """Commit what a call of max_frames frames could need (its prompt not yet known: the longest allowed)."""
        return self.commit(slot, self.max_prompt_tokens + max_frames, self.prompt_frames + max_frames)

    def admitted(self, call: Call) -> None:
        """The call's prompt is known (call.prompt_tokens): the LLM commitment shrinks to it, and the pages its
        admission writes (the prompt, the talker's warm-up) and its first steps need are given."""
        self.trim(call.slot, call.prompt_tokens + call.max_frames)
        self._grow_for(call)

    def before_step(self, call: Call) -> None:
        """Pages for the positions the call's next step writes (its LLM prompt + frame, its talker
        prompt_frames + frame), taken a page ahead so most steps take none."""
        if call.frames_stepped + 2 > call.kv_frames:
            self._grow_for(call)

    def _grow_for(self, call: Call) -> None:
        frames = call.frames_stepped + 2 + self.page_len
        self.grow(call.slot, call.prompt_tokens + frames, self.prompt_frames + frames)
        call.kv_frames = frames

    # ---- commitments (any thread) -------------------------------------------------------------------
    def commit(self, slot: int, llm_positions: int, talker_positions: int) -> bool:
        """Commit the pages a call of these many positions could need; False (nothing committed) if they
        do not fit beside the live calls' commitments."""
        llm, talker = self.pages_for(llm_positions), self.pages_for(talker_positions)
        if llm > self.max_pages[0] or talker > self.max_pages[1]:
            raise ValueError(f"{llm_positions} / {talker_positions} positions exceed a slot's page table")
        with self._lock:
            if slot in self._claims:
                raise ValueError(f"slot {slot} already holds pages")
            if llm > self.llm.uncommitted or talker > self.talker.uncommitted:
                return False
            self.llm.promised += llm
            self.talker.promised += talker
            self._claims[slot] = _Claim(llm, talker)
            return True

    def trim(self, slot: int, llm_positions: int) -> None:
        """Lower the slot's LLM commitment to llm_positions (its prompt is known now)."""
        with self._lock:
            claim = self._claims[slot]
            keep = max(self.pages_for(llm_positions), len(claim.llm))
            self.llm.promised -= claim.llm_limit - keep
            claim.llm_limit = keep

    # ---- pages (the engine thread) ------------------------------------------------------------------
    def grow(self, slot: int, llm_positions: int, talker_positions: int) -> None:
        """Give the slot pages for positions [0, llm_positions) of the LLM and [0, talker_positions) of the
        talker, within its commitment (never past it: the call's limit stops it first)."""
        with self._lock:
            claim = self._claims[slot]
            llm = min(self.pages_for(llm_positions), claim.llm_limit)
            talker = min(self.pages_for(talker_positions), claim.talker_limit)
            new_llm = self._take(self.llm, claim.llm, llm)
            new_talker = self._take(self.talker, claim.talker, talker)
        llm_writes = [(slot, j, page) for j, page in new_llm]
        talker_writes = [(stream * self.slots + slot, j, talker_pool_page(stream, page, self.talker.num_pages))
                         for j, page in new_talker for stream in (0, 1)]   # both CFG streams, each its own half
        if self._deferred is not None:
            self._deferred[0].extend(llm_writes)
            self._deferred[1].extend(talker_writes)
        else:
            _write(self.llm_table, llm_writes)
            _write(self.talker_table, talker_writes)

    @contextlib.contextmanager
    def writes_together(self):
        """The table writes of the grows inside are made at its end, one per table. Why: in lockstep every
        call reaches a new page in the same step, and a write per page (3 per call) was ~770 small device
        writes before that step at 256 calls, every page_len frames."""
        self._deferred = ([], [])
        try:
            yield
        finally:
            (llm_writes, talker_writes), self._deferred = self._deferred, None
            _write(self.llm_table, llm_writes)
            _write(self.talker_table, talker_writes)

    @staticmethod
    def _take(pool: _Pool, held: list[int], want: int) -> list[tuple[int, int]]:
        new = []
        while len(held) < want:
            page = pool.free.pop()
            pool.promised -= 1
            new.append((len(held), page))
            held.append(page)
        return new

    def release(self, slot: int) -> None:
        """The call in `slot` ended: its pages and what it had committed go back; its table rows name the sink."""
        with self._lock:
            claim = self._claims.pop(slot, None)
            if claim is None:
                return
            self.llm.promised -= claim.llm_limit - len(claim.llm)
            self.talker.promised -= claim.talker_limit - len(claim.talker)
            self.llm.free.extend(claim.llm)
            self.talker.free.extend(claim.talker)
        if claim.llm:
            self.llm_table[slot].fill_(self.llm.num_pages)
        if claim.talker:
            sink = self.talker.num_pages
            for stream in (0, 1):
                self.talker_table[stream * self.slots + slot].fill_(talker_pool_page(stream, sink, sink))

    # ---- what /metrics and tests read ---------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        with self._lock:
            return {"llm_pages": self.llm.num_pages, "llm_pages_free": len(self.llm.free),
                    "llm_pages_uncommitted": self.llm.uncommitted, "talker_pages": self.talker.num_pages,
                    "talker_pages_free": len(self.talker.free), "talker_pages_uncommitted": self.talker.uncommitted}


def _write(table: torch.Tensor, entries: list[tuple[int, int, int]]) -> None:
    """table[row, column] = page for every (row, column, page): one copy to the device and one write."""
    if entries:
        rows, columns, pages = torch.tensor(entries, dtype=torch.int64).to(table.device).unbind(1)
        table[rows, columns] = pages.to(table.dtype)


def whole_call_state(model, calls: int, frames: int, device, max_prompt_tokens: int, page_len: int) -> CallState:
    """Paged pools for `calls` calls of up to max_prompt_tokens + `frames` positions, every slot holding the
    pages of its whole length (as such a call would by its end): the state a benchmark or a test steps
    without an engine to hand pages out."""
    cfg = model.cfg
    counts = kv_page_counts(cfg, calls, frames * cfg.frame_length, max_prompt_tokens, page_len)
    st = allocate_call_state(model, calls, frames, device, max_prompt_tokens, counts)
    pages = KVPages(st, cfg.prompt_frames, max_prompt_tokens)
    for slot in range(calls):
        assert pages.open_call(slot, frames)
        pages.grow(slot, max_prompt_tokens + frames, cfg.prompt_frames + frames)
    return st
