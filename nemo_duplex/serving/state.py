"""Per-call state: one pool per kind of state, allocated once for `max_calls` slots.

Every pool has `max_calls + 1` rows; the last is the sink that padding rows of a captured batch point at,
so padding never touches a real call (docs/design.md). The engine owns one `CallState`; model code only
reads and writes the rows it is given.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, fields, is_dataclass

import torch

from nemo_duplex.models.config import ModelConfig, torch_dtype
from ops import check_fp8_device
from ops.kv_pages import kv_places


@dataclass(frozen=True)
class KVPageCounts:
    """How big the paged KV pools are: pages of page_len positions, so many for the LLM's attention layers
    and so many for the talker's (each stream), the sink page not counted (serving/pages.py sizes them)."""
    page_len: int
    llm: int
    talker: int


@dataclass
class CallState:
    encoder: object          # encoder.EncoderStreamState: front-end tails, bounded KV window, conv caches
    rnnt: object | None      # rnnt.RNNTStreamState: prediction-net LSTM state, last token
    llm: object              # llm.LLMCache: Mamba conv + SSM states, attention KV
    talker: object           # talker.TalkerCache: KV of the cond and uncond streams
    codec: object            # codec.CodecStreamState: causal-conv and iSTFT tails
    llm_len: torch.Tensor    # [S] int64: tokens in the LLM attention KV
    talker_pos: torch.Tensor  # [S] int64: next talker position
    frame: torch.Tensor      # [S] int64: audio frames done (the call's RNG counter)
    speech_frame: torch.Tensor  # [S] int64: frames whose speech (talker + codec) is done (the talker's RNG counter)
    pending_text: torch.Tensor  # [S] int64: the text token of the frame whose speech is next (pipelined steps)
    pending_audio: torch.Tensor  # [S, H] LLM dtype: the projected encoder frame whose text is next (two-deep steps)
    prev_text: torch.Tensor  # [S] int64
    prev_func: torch.Tensor  # [S] int64
    prev_codes: torch.Tensor  # [S, Q] int64
    seed: torch.Tensor       # [S] int64: the call's generator key
    temperature: torch.Tensor  # [S] float32
    top_p: torch.Tensor      # [S] float32
    rep_penalty: torch.Tensor  # [S] float32
    greedy: torch.Tensor     # [S] bool
    seen: torch.Tensor       # [S, V] bool: non-special tokens the call generated (repetition penalty)
    max_calls: int
    max_frames: int

    @property
    def sink(self) -> int:
        return self.max_calls

    def nbytes_per_slot(self) -> dict[str, int]:
        """Bytes of each kind of state one call holds (memory planning, nemo_duplex/serving/memory.py)."""
        rows = self.max_calls + 1
        def size(obj) -> int:
            return sum(t.numel() * t.element_size() for _, t in state_tensors(obj))
        per = {name: size(getattr(self, name)) // rows for name in ("encoder", "rnnt", "llm", "talker", "codec")}
        # every other tensor field: the per-call scalars, masks and token rows (none can be left out of the count)
        per["scalars"] = sum(size(getattr(self, f.name)) for f in fields(self)
                             if f.name not in per and isinstance(getattr(self, f.name), torch.Tensor)) // rows
        return per


def state_tensors(obj, prefix: str = ""):
    """(name, tensor) for every tensor under a state object: tensor fields, lists of tensors (the
    codec's per-layer histories) and nested state dataclasses. None yields nothing."""
    if obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield prefix.rstrip("."), obj
        return
    if isinstance(obj, (list, tuple)):
        for i, t in enumerate(obj):
            yield from state_tensors(t, f"{prefix}{i}.")
        return
    if is_dataclass(obj):
        for f in fields(obj):
            yield from state_tensors(getattr(obj, f.name), f"{prefix}{f.name}.")


def allocate_call_state(model, max_calls: int, max_frames: int, device: torch.device,
                        max_prompt_tokens: int = 512, kv_pages: "KVPageCounts | None" = None) -> CallState:
    """Allocate every pool once. `max_frames` bounds a call (the LLM and talker KV lengths). With `kv_pages`
    the LLM's and the talker's KV pools are paged (ops/kv_pages.py, serving/pages.py hands the pages out):
    that many pages of page_len positions each, whatever max_calls and max_frames would take."""
    cfg: ModelConfig = model.cfg
    S = max_calls + 1
    d = cfg.dtype
    llm_dtype, talker_kv_dtype = torch_dtype(d.llm), torch_dtype(d.talker_kv_pool)
    if d.talker_kv_pool == "fp8":
        check_fp8_device(torch.device(device), "model.dtype.talker_kv=fp8")
    i64 = dict(dtype=torch.int64, device=device)
    paged = dict(llm={}, talker={})
    if kv_pages is not None:
        paged = dict(llm=dict(page_len=kv_pages.page_len, num_pages=kv_pages.llm),
                     talker=dict(page_len=kv_pages.page_len, num_pages=kv_pages.talker))
    return CallState(
        encoder=model.perception.allocate_stream_state(S, device, torch_dtype(d.encoder)),
        rnnt=model.stt_model.rnnt_decoder.allocate_stream_state(S, device) if model.has_rnnt else None,
        llm=model.llm.allocate_cache(S, max_prompt_tokens + max_frames, device, llm_dtype,
                                     ssm_dtype=torch_dtype(d.mamba_ssm_state), **paged["llm"]),
        talker=model.talker.allocate_cache(S, cfg.prompt_frames + max_frames, device, talker_kv_dtype,
                                           **paged["talker"]),
        codec=model.codec.allocate_stream_state(S, device),
        llm_len=torch.zeros(S, **i64), talker_pos=torch.zeros(S, **i64), frame=torch.zeros(S, **i64),
        speech_frame=torch.zeros(S, **i64), pending_text=torch.zeros(S, **i64),
        pending_audio=torch.zeros(S, cfg.llm.hidden_size, dtype=llm_dtype, device=device),
        prev_text=torch.zeros(S, **i64), prev_func=torch.zeros(S, **i64),
        prev_codes=torch.zeros(S, cfg.talker.num_quantizers, **i64), seed=torch.zeros(S, **i64),
        temperature=torch.zeros(S, device=device), top_p=torch.ones(S, device=device),
        rep_penalty=torch.ones(S, device=device), greedy=torch.ones(S, dtype=torch.bool, device=device),
        seen=torch.zeros(S, cfg.llm.vocab_size, dtype=torch.bool, device=device),
        max_calls=max_calls, max_frames=max_frames)


class SlotAllocator:
    """Free list of slot indices. Thread safe: the server thread admits, the engine thread frees."""

    def __init__(self, max_calls: int):
        self._free = list(range(max_calls - 1, -1, -1))
        self._taken: set[int] = set()
        self._lock = threading.Lock()
        self.max_calls = max_calls

    def take(self) -> int | None:
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self._taken.add(slot)
            return slot

    def give(self, slot: int) -> None:
        with self._lock:
            if slot not in self._taken:
                raise ValueError(f"slot {slot} is not taken")
            self._taken.remove(slot)
            self._free.append(slot)

    @property
    def in_use(self) -> int:
        with self._lock:
            return len(self._taken)


class PrefixCache:
    """Admission results by (system prompt ids, speaker): the LLM's Mamba and attention state after the
    prompt prefill and the talker's KV after the speaker warm-up. A call whose prompt and speaker were
    seen before gets them copied into its slot instead of recomputed. Bounded in bytes, least recently
    used out first (engine.prefix_cache_mib): an entry's size is what it holds, at full size the fp32 SSM
    state (~141 MB) plus its prompt's KV, so a long prompt takes the room of more than one short one; an
    entry larger than the whole cache is not kept.

    A prompt enters only on its second admission (a doorkeeper of the last 4096 keys' hashes): a stream of
    calls each with a fresh prompt would otherwise evict every shared prompt in turn, for entries that are
    never used again; the prompts that recur (a deployment's system prompts) are kept."""
    DOORKEEPER = 4096

    def __init__(self, max_bytes: int):
        from collections import OrderedDict
        self.max_bytes = int(max_bytes)
        self._entries: "OrderedDict[tuple, dict]" = OrderedDict()
        self._seen: "OrderedDict[int, None]" = OrderedDict()   # hashes of keys admitted once
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def entry_bytes(snap: dict) -> int:
        return sum(t.numel() * t.element_size() for t in snap.values())

    def __contains__(self, key: tuple) -> bool:   # (counts nothing, moves nothing)
        return key in self._entries

    def get(self, key: tuple, calls: int = 1) -> dict | None:
        """The entry for `key`, for `calls` admissions (a hit or a miss each), or None."""
        snap = self._entries.get(key)
        if snap is None:
            self.misses += calls
            return None
        self._entries.move_to_end(key)
        self.hits += calls
        return snap

    def wants(self, key: tuple) -> bool:
        """Whether an admission of `key` should be snapshotted: it was admitted before (else remember it)."""
        if self.max_bytes <= 0:
            return False
        h = hash(key)
        if h in self._seen:
            return True
        self._seen[h] = None
        while len(self._seen) > self.DOORKEEPER:
            self._seen.popitem(last=False)
        return False

    def put(self, key: tuple, snap: dict) -> None:
        size = self.entry_bytes(snap)
        if size > self.max_bytes:
            return
        if key in self._entries:
            self.bytes -= self.entry_bytes(self._entries.pop(key))
        while self._entries and self.bytes + size > self.max_bytes:
            self.bytes -= self.entry_bytes(self._entries.popitem(last=False)[1])
        self._entries[key] = snap
        self.bytes += size

    @staticmethod
    def _places(st: CallState, slots: torch.Tensor, prompt_len: int, warmup_len: int):
        """Where the first prompt_len LLM positions and warmup_len talker positions (both streams) of each slot
        in `slots` [K] live: (row, offset) index pairs into every layer's pool at once (ops/kv_pages.py), [K,
        prompt_len] and [2 streams, K, warmup_len], so a snapshot or a restore is one gather or scatter per
        pool, not one per layer or per call."""
        llm, tk = st.llm, st.talker
        dev = llm.conv.device
        llm_at = kv_places(llm.pages, llm.k.shape[3], slots[:, None], torch.arange(prompt_len, device=dev))
        rows = torch.stack([slots, slots + tk.num_slots])[:, :, None]   # the talker's two streams
        talker_at = kv_places(tk.pages, tk.k.shape[4], rows, torch.arange(warmup_len, device=dev))
        return torch.broadcast_tensors(*llm_at), torch.broadcast_tensors(*talker_at)

    @staticmethod
    def snapshot(st: CallState, slot: int, prompt_len: int, warmup_len: int) -> dict:
        """The slot's admission state: k, v [n_attn, kv, prompt_len, D]; talker_k, talker_v
        [layers, 2 streams, kv, warmup_len, D] (the same shapes whether the pools are paged or not)."""
        llm, tk = st.llm, st.talker
        (lr, lo), (tr, to) = PrefixCache._places(st, torch.tensor([slot], device=llm.conv.device), prompt_len,
                                                 warmup_len)
        talker = [pool.flatten(1, 2)[:, tr[:, 0], :, to[:, 0]].permute(2, 0, 3, 1, 4)   # [L, 2, kv, w, D]
                  for pool in (tk.k, tk.v)]
        return {"conv": llm.conv[:, slot].clone(), "ssm": llm.ssm[:, slot].clone(),
                "k": llm.k[:, lr[0], :, lo[0]].permute(1, 2, 0, 3), "v": llm.v[:, lr[0], :, lo[0]].permute(1, 2, 0, 3),
                "talker_k": talker[0], "talker_v": talker[1]}

    @staticmethod
    def restore(st: CallState, slots: torch.Tensor, snap: dict) -> None:
        """Copy one snapshot into every slot of `slots` [K] (int64, on the pools' device): a fixed number of
        scatters whatever K, so calls that open together are admitted together (serving/admitter.py)."""
        llm, tk = st.llm, st.talker
        (lr, lo), (tr, to) = PrefixCache._places(st, slots, snap["k"].shape[-2], snap["talker_k"].shape[-2])
        llm.conv[:, slots] = snap["conv"][:, None]
        llm.ssm[:, slots] = snap["ssm"][:, None]
        llm.k[:, lr, :, lo] = snap["k"].permute(2, 0, 1, 3)     # [n_attn, kv, p, D] -> [p, n_attn, kv, D], per slot
        llm.v[:, lr, :, lo] = snap["v"].permute(2, 0, 1, 3)
        # [L, 2, kv, w, D] -> [2, 1, w, L, kv, D]: the same for each slot
        tk.k.flatten(1, 2)[:, tr, :, to] = snap["talker_k"].permute(1, 3, 0, 2, 4)[:, None]
        tk.v.flatten(1, 2)[:, tr, :, to] = snap["talker_v"].permute(1, 3, 0, 2, 4)[:, None]
