"""One 80 ms frame for a batch of calls, and the admission of a call into its slot (spec 7.2).

`frame_step` is a pure tensor function over the state pools: no host syncs, no Python branching on
values, fixed shapes for a given batch size. That is what lets graphs/ capture it per bucket. Rows are
calls (their slot indices); padding rows point at the sink slot.

Per frame: encoder frame -> fusion with the previous text and function tokens -> one cached LLM step ->
text token (sampled per call) and function token (greedy; or forced by a tool result) -> talker step
(31 codes) -> codec (1764 PCM samples); plus the RNN-T user-transcript tokens of the frame.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.profiler import record_function

from nemo_duplex.models import rng
from nemo_duplex.models.config import SamplingParams
from nemo_duplex.models.model import ClipResult
from nemo_duplex.models.sampling import sample_text
from nemo_duplex.serving.state import CallState, PrefixCache, allocate_call_state
from ops.argmax_top2 import argmax_top2

if TYPE_CHECKING:
    from nemo_duplex.serving.admission_graphs import AdmissionGraphs


@dataclass
class StepOutput:
    text: torch.Tensor       # [B] int64 agent text token
    func: torch.Tensor       # [B] int64 function-channel token
    top2: torch.Tensor       # [B, 2] top-1/top-2 text logits (margins)
    codes: torch.Tensor      # [B, Q] int64
    pcm: torch.Tensor        # [B, 1764] float32 in [-1, 1] (22.05 kHz)
    user: torch.Tensor       # [B, max_symbols] int64 RNN-T tokens of this frame, -1 padded
    enc: torch.Tensor        # [B, d_enc] encoder frame before projection


@contextlib.contextmanager
def branch(side_stream: torch.cuda.Stream | None):
    """Queue the work inside on `side_stream`, after everything queued so far on the current stream; the
    current stream goes on without waiting for it (`join` makes it wait). Under graph capture the branch
    becomes a parallel path of the graph. None: the work runs in order on the current stream.

    Why: most of a step is one chain of small dependent kernels (encoder -> LLM -> talker -> codec), each
    too short to fill the GPU, so the RNN-T's ~180 kernels, which need only the encoder's frame, cost their
    whole length when queued in the chain and nothing beside it.
    Memory: every tensor the branch reads stays referenced in frame_step until `join` is queued, and what
    the branch allocates is freed to its own stream, so no block is reused while the other stream uses it."""
    if side_stream is None:
        yield
        return
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
        yield


def join(side_stream: torch.cuda.Stream | None) -> None:
    if side_stream is not None:
        torch.cuda.current_stream().wait_stream(side_stream)


@contextlib.contextmanager
def sm_carveout(sms: int):
    """cuBLASLt GEMMs queued inside target all SMs but `sms` (torch's SM carveout), so that kernels of
    the step's other streams find SMs free while they run; captured, the GEMMs keep that launch shape.
    Another SM target can make cuBLASLt pick another kernel, and so round differently: a step's outputs
    are comparable bit for bit only between steps run with the same carveout. 0: untouched."""
    if not sms:
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)


def frame_step(model, st: CallState, slots: torch.Tensor, audio: torch.Tensor, forced_func: torch.Tensor,
               special_ids: torch.Tensor, sampling: bool = True,
               side_stream: torch.cuda.Stream | None = None, speech_slots: torch.Tensor | None = None,
               speech_stream: torch.cuda.Stream | None = None, text_slots: torch.Tensor | None = None,
               encoder_stream: torch.cuda.Stream | None = None, llm_sm_carveout: int = 0) -> StepOutput:
    """slots [B] int64: each row's call, whose next 80 ms audio [B, 1280] float32 this step hears.
    forced_func [B] int64: -1 = the model's own tokens; >= 0 the tool-result token to force on the function
    channel, the text channel PAD (spec 3.9); <= -2 the text token -2 - forced_func to force on the text
    channel (an on-hold message, serving.calls.forced_text). `sampling=False` when the caller knows every row is greedy: the text token is
    then the argmax, which is what `sample_text` returns for greedy rows, without its sort and cumulative
    sums over the vocabulary. `side_stream` (CUDA): the work off the step's critical path (the RNN-T; the
    text's bookkeeping) runs there, beside the rest (`branch`); the results are the same bit for bit, only
    the kernels' order changes.

    A frame goes through three halves: listening (encoder, its projection, the RNN-T), text (LLM, heads,
    sampling) and speech (talker, codec). Serially (the default) one step runs all three for the frame it
    hears. Pipelined (engine.pipeline), a step's halves belong to different frames of the call, and read
    no state another half of the same step writes, so on CUDA each runs on its own stream, filling the time
    the others' chains of small dependent kernels leave the GPU part idle:
    - one deep (`speech_slots` given): the speech half is that of the frame the row's call heard in its
      previous step, whose text token that step left in `st.pending_text`. H200, N=32, position 1000:
      16.81 -> 14.67 ms a step (docs/performance.md).
    - two deep (`text_slots` given too): the text half is that of the frame heard in the previous step,
      whose projected encoder frame that step left in `st.pending_audio`, and the speech half that of the
      frame heard two steps ago. The listening half runs on `encoder_stream`, so the encoder is off the
      step's critical path: 14.79 -> 14.04 ms (docs/performance.md), 13.4-13.6 with the text half's
      GEMMs leaving half the SMs to the talker (engine.llm_sm_carveout=auto).
    A row's entry in `slots`, `text_slots` or `speech_slots` is the sink where its call has no frame for
    that half (a call's first steps, its last steps after its input ended, a padding row). The outputs
    belong to the halves' frames: enc and user to `slots`', text, func and top2 to `text_slots`', codes
    and pcm to `speech_slots`'. Their values are the serial step's, one or two steps later
    (tests/test_pipeline.py). `llm_sm_carveout`: the text half's GEMMs leave that many SMs to the other
    halves' kernels (`sm_carveout`; engine.llm_sm_carveout)."""
    if speech_slots is not None:
        # gathered on the step's stream before this step writes pending_text below
        speech_text = st.pending_text[speech_slots]
        with branch(speech_stream):
            codes, pcm = speech_step(model, st, speech_slots, speech_text)
    if text_slots is None:  # the text half is this step's frame
        enc, a, user = listen_step(model, st, slots, audio, side_stream)
        text_slots = slots
    else:
        a = st.pending_audio[text_slots]  # gathered before the listening half below writes the pool
        with branch(encoder_stream):
            enc, heard, user = listen_step(model, st, slots, audio, side_stream)
            st.pending_audio.index_copy_(0, slots, heard)
    with sm_carveout(llm_sm_carveout):
        text, func, top2, frame, advance = text_step(model, st, text_slots, a, forced_func, special_ids,
                                                     sampling, side_stream)
    if speech_slots is None:  # serial: the frame and its advance are the text half's own (no second gather)
        codes, pcm = speech_step(model, st, text_slots, text, frame, advance)
    else:
        st.pending_text.index_copy_(0, text_slots, text)
    st.frame.index_copy_(0, text_slots, frame + advance)
    join(side_stream)
    join(encoder_stream)
    join(speech_stream)
    return StepOutput(text=text, func=func, top2=top2, codes=codes, pcm=pcm, user=user, enc=enc)


def listen_step(model, st: CallState, slots: torch.Tensor, audio: torch.Tensor,
                side_stream: torch.cuda.Stream | None = None):
    """The encoder frame of each row's next 80 ms (before projection), its projection into the LLM's
    embedding space (the LLM's dtype), and the RNN-T's user-transcript tokens of the frame."""
    with record_function("encoder"):
        enc = model.perception.stream_step(audio, st.encoder, slots)
        a = model.perception.project(enc).to(model.stt_model.embed_tokens.weight.dtype)
    with branch(side_stream), record_function("rnnt"):  # needs only the encoder's frame
        if model.has_rnnt:
            user = model.stt_model.rnnt_decoder.stream_step(model.stt_model.rnnt_joint, enc, st.rnnt, slots)
        else:
            user = torch.full((slots.shape[0], 1), -1, dtype=torch.int64, device=slots.device)
    return enc, a, user


def text_step(model, st: CallState, slots: torch.Tensor, a: torch.Tensor, forced_func: torch.Tensor,
              special_ids: torch.Tensor, sampling: bool, side_stream: torch.cuda.Stream | None):
    """The LLM step of each row's frame from its projected encoder frame `a`: (text, func, top2, frame,
    advance), frame the rows' frame counters (the sampler's key) and advance (slots != sink); the caller
    advances `st.frame`."""
    cfg = model.cfg
    pad = cfg.tokens.pad_id
    # Padding rows all point at the sink: it must never advance, or after max_frames padded steps its
    # positions would index past the KV pools (a device-side assert that ends every call on the GPU).
    advance = (slots != st.sink).to(torch.int64)
    x = model.fuse(a, st.prev_text[slots], st.prev_func[slots])
    with record_function("llm"):
        lengths = st.llm_len[slots]
        h = model.llm.step(x, st.llm, slots, lengths)
        st.llm_len.index_copy_(0, slots, lengths + advance)
    with record_function("heads"):
        text_logits, func_logits = model.heads(h)
    frame = st.frame[slots]
    # the greedy token and the margins (top-1 / top-2 logits) in one pass over the logits' own dtype (the
    # values torch's argmax and topk give; ops/argmax_top2.py): the upcast to fp32 is exact, so an fp32 copy
    # of [B, vocab] first would change nothing but cost a copy
    greedy_text, top2 = argmax_top2(text_logits)
    if sampling:
        text = sample_text(text_logits, special_ids, st.seen[slots], st.temperature[slots], st.top_p[slots],
                           st.rep_penalty[slots], st.greedy[slots], st.seed[slots], frame)
    else:
        text = greedy_text
    func = func_logits.argmax(-1) if func_logits is not None else torch.full_like(text, pad)
    # forced >= 0: a tool result's token on the function channel, the text channel PAD (spec 3.9);
    # forced <= -2: the text token -2 - forced (an on-hold message the talker speaks); -1: the model's own
    forcing = forced_func >= 0
    func = torch.where(forcing, forced_func, func)
    text = torch.where(forcing, torch.full_like(text, pad), torch.where(forced_func <= -2, -2 - forced_func, text))
    with branch(side_stream):  # the text's bookkeeping: nothing below reads it
        st.prev_text.index_copy_(0, slots, text)
        st.prev_func.index_copy_(0, slots, func)
        newly_seen = torch.zeros_like(st.seen[slots]).scatter_(1, text[:, None], True)
        newly_seen &= ~torch.isin(text, special_ids)[:, None]
        st.seen.index_copy_(0, slots, st.seen[slots] | newly_seen)
    return text, func, top2, frame, advance


def speech_step(model, st: CallState, slots: torch.Tensor, text: torch.Tensor, frame: torch.Tensor | None = None,
                advance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The talker's 31 codes and the codec's 1764 samples of each row's next speech frame, from that
    frame's text token [B]; advances the rows' talker position and speech frame (sink rows excepted).
    The talker's draws are keyed by the speech frame, which is the frame the text was made in, so the
    serial and pipelined steps draw the same numbers. `frame`, `advance`: the rows' speech frame and
    (slots != sink) when the caller has them already (the serial step: there speech_frame == frame)."""
    cfg = model.cfg
    advance = (slots != st.sink).to(torch.int64) if advance is None else advance
    frame = st.speech_frame[slots] if frame is None else frame
    with record_function("talker"):
        u, z = rng.talker_draws(st.seed[slots], frame, model.talker.num_passes, cfg.talker.mog.num_predictions,
                                cfg.talker.latent_size)
        positions = st.talker_pos[slots]
        codes = model.talker.step(text, st.prev_codes[slots], st.talker, slots, positions, u, z, model.silence_codes)
        st.talker_pos.index_copy_(0, slots, positions + advance)
    with record_function("codec"):
        pcm = model.codec.decode_step(codes, st.codec, slots)
    st.prev_codes.index_copy_(0, slots, codes)
    st.speech_frame.index_copy_(0, slots, frame + advance)
    return codes, pcm


@torch.no_grad()
def admit(model, st: CallState, slot: int, prompt_ids: torch.Tensor | None, seed: int,
          sampling: SamplingParams, speaker: str | None = None, prefix_cache: PrefixCache | None = None) -> None:
    """Reset `slot` and bring it to the state of a call about to hear its first frame: LLM prefill of
    the system prompt (spec 1.3) and the talker's 37-position speaker warm-up (spec 4.3). With a
    prefix cache, a prompt and speaker seen before are copied in instead of recomputed."""
    for _ in admission(model, st, slot, prompt_ids, seed, sampling, speaker, prefix_cache):
        pass


def prompt_pieces(tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(start, length) of the pieces a prompt of `tokens` tokens is prefilled in: whole when chunk_tokens is
    0, else pieces of chunk_tokens and the rest in falling powers of two (500 by 256: 256, 128, 64, 32, 16,
    4). With chunk_tokens a power of two every piece is one, so a graph per power of two up to it covers
    every prompt exactly (serving/admission_graphs.py)."""
    if chunk_tokens <= 0:
        return [(0, tokens)] if tokens else []
    pieces, start = [], 0
    while start < tokens:
        rest = tokens - start
        size = chunk_tokens if rest >= chunk_tokens else 1 << (rest.bit_length() - 1)
        pieces.append((start, size))
        start += size
    return pieces


def admission_key(model, prompt_ids: torch.Tensor | None, speaker: str | None) -> tuple:
    """What a call's admitted state depends on, besides its seed and sampling: its system prompt's ids and
    its speaker (the prefix cache's key)."""
    has_prompt = prompt_ids is not None and prompt_ids.numel() > 0
    return tuple(prompt_ids.tolist()) if has_prompt else (), speaker or model.cfg.talker.speaker


@torch.no_grad()
def admission(model, st: CallState, slot: int, prompt_ids: torch.Tensor | None, seed: int,
              sampling: SamplingParams, speaker: str | None = None, prefix_cache: PrefixCache | None = None,
              chunk_tokens: int = 0, graphs: AdmissionGraphs | None = None) -> Iterator[None]:
    """`admit` in pieces, one per next(): the prompt's prefill in `prompt_pieces` of at most `chunk_tokens`
    tokens (0: whole), then the talker's warm-up and the slot's scalars. The engine runs a bounded number of
    pieces between two steps, so a new call's long prompt never stalls the live ones' step
    (engine.prefill_chunk_tokens). Each piece continues the last: attention over the keys already in the
    pool, the Mamba layers from the conv and SSM state the previous piece left (tests/test_engine.py:
    chunked == whole). `graphs`: the prefill pieces and the warm-up replayed from CUDA graphs
    (engine.prefill_graphs), the same computation."""
    cfg = model.cfg
    dev = st.llm_len.device
    s = torch.tensor([slot], dtype=torch.int64, device=dev)
    model.perception.reset_slots(st.encoder, s)
    if st.rnnt is not None:
        model.stt_model.rnnt_decoder.reset_slots(st.rnnt, s)
    model.llm.reset_slots(st.llm, s)
    model.codec.reset_slots(st.codec, s)
    has_prompt = prompt_ids is not None and prompt_ids.numel() > 0
    P = prompt_ids.shape[0] if has_prompt else 0
    key = admission_key(model, prompt_ids, speaker)
    snap = prefix_cache.get(key) if prefix_cache is not None else None
    if snap is not None:
        PrefixCache.restore(st, s, snap)
    else:
        if has_prompt:
            x = model.prompt_embeddings(prompt_ids.to(dev))[None]
            for start, size in prompt_pieces(P, chunk_tokens):
                at = torch.full((1,), start, dtype=torch.int64, device=dev)
                if graphs is not None:
                    graphs.prefill(x[:, start: start + size], s, at)
                else:
                    model.llm.prefill(x[:, start: start + size], st.llm, s, at)
                yield
        if graphs is not None:
            graphs.warmup(s, speaker)
        else:
            model.talker.prefill_warmup(st.talker, s, model.speaker_latent(speaker), model.silence_codes)
        if prefix_cache is not None and prefix_cache.wants(key):
            prefix_cache.put(key, PrefixCache.snapshot(st, slot, P, cfg.prompt_frames))
    start_slots(model, st, s, [P], [seed], [sampling])


def start_slots(model, st: CallState, slots: torch.Tensor, prompt_lens: list[int], seeds: list[int],
                samplings: list[SamplingParams]) -> None:
    """The per-call scalars of calls about to hear their first frame, rows `slots` [K]: their prompt's length
    in the LLM's KV, the talker after its warm-up, frame counters at 0, PAD as the previous tokens and
    codes, the seed and sampling settings, nothing seen. Three host-to-device copies and a write per field,
    whatever K."""
    cfg = model.cfg
    pad, dev = cfg.tokens.pad_id, st.llm_len.device
    ints = torch.tensor([[p, cfg.prompt_frames, seed] for p, seed in zip(prompt_lens, seeds)],
                        dtype=torch.int64).to(dev)
    floats = torch.tensor([[s.temperature, s.top_p, s.repetition_penalty] for s in samplings],
                          dtype=torch.float32).to(dev)
    greedy = torch.tensor([s.greedy for s in samplings], dtype=torch.bool).to(dev)
    st.llm_len[slots] = ints[:, 0]
    st.talker_pos[slots] = ints[:, 1]
    st.seed[slots] = ints[:, 2]
    for counter in (st.frame, st.speech_frame):
        counter.index_fill_(0, slots, 0)
    for token in (st.pending_text, st.prev_text, st.prev_func):
        token.index_fill_(0, slots, pad)
    st.prev_codes.index_fill_(0, slots, cfg.talker.speech_pad_code)
    st.temperature[slots] = floats[:, 0]
    st.top_p[slots] = floats[:, 1]
    st.rep_penalty[slots] = floats[:, 2]
    st.greedy[slots] = greedy
    st.seen.index_fill_(0, slots, False)


@torch.no_grad()
def restore_admissions(model, st: CallState, slots: list[int], snap: dict, seeds: list[int],
                       samplings: list[SamplingParams]) -> None:
    """Admit calls whose prompt and speaker the prefix cache holds (`snap`, one entry for all) all at once:
    the state `admission` leaves in each slot, bit for bit (tests/test_admitter.py), in a fixed number of
    device ops whatever the number of calls. Why: calls that open together (a burst of callers) were
    admitted one by one, ~50 small launches and a wait each, so the last of 256 waited for all the others."""
    dev = st.llm_len.device
    s = torch.tensor(slots, dtype=torch.int64, device=dev)
    model.perception.reset_slots(st.encoder, s)
    if st.rnnt is not None:
        model.stt_model.rnnt_decoder.reset_slots(st.rnnt, s)
    # (the LLM's reset is left out: the restore below writes its whole recurrent state)
    model.codec.reset_slots(st.codec, s)
    PrefixCache.restore(st, s, snap)
    start_slots(model, st, s, [snap["k"].shape[-2]] * len(slots), seeds, samplings)


def special_ids(model, device) -> torch.Tensor:
    t = model.cfg.tokens
    return torch.tensor([t.pad_id, t.bos_id, t.eos_id], dtype=torch.int64, device=device)


@torch.no_grad()
def stream_inference(model, audio: torch.Tensor, prompt_ids: torch.Tensor | None = None, seed: int = 0,
                     sampling: SamplingParams | None = None):
    """The streaming reference (spec 7.2) as a plain loop: one call, one 1280-sample chunk per step
    (a partial last chunk is zero-padded, as at end of input), cached state throughout."""
    dev = model.stt_model.embed_tokens.weight.device
    n = model.cfg.samples_per_frame_in
    audio = audio.to(dev, torch.float32)
    K = -(-audio.shape[0] // n)
    chunks = torch.nn.functional.pad(audio, (0, K * n - audio.shape[0])).view(K, n)
    st = allocate_call_state(model, 1, K, dev, max_prompt_tokens=0 if prompt_ids is None else prompt_ids.numel())
    admit(model, st, 0, prompt_ids, seed, sampling or SamplingParams())
    slots = torch.zeros(1, dtype=torch.int64, device=dev)
    no_force = torch.full((1,), -1, dtype=torch.int64, device=dev)
    specials = special_ids(model, dev)
    outs = [frame_step(model, st, slots, chunks[k: k + 1], no_force, specials) for k in range(K)]
    cat = lambda name: torch.cat([getattr(o, name) for o in outs])  # noqa: E731
    enc = cat("enc")
    user = cat("user")
    return ClipResult(encoder_out=enc, audio_embeds=model.perception.project(enc), text_tokens=cat("text"),
                      function_tokens=cat("func"), text_logits_top2=cat("top2"), codes=cat("codes"),
                      wav=cat("pcm").reshape(-1), user_tokens=[int(t) for t in user.reshape(-1) if t >= 0])
