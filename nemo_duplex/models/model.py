"""VoiceChat: the four parts under the official checkpoint prefixes, the channel fusion, the heads, and
NVIDIA's offline reference loop (spec 7.1).

Module paths are the checkpoint keys (docs/design.md): `stt_model.perception.*`, `stt_model.llm.*`,
`stt_model.embed_tokens`, `stt_model.lm_head`, `stt_model.function_head`, `stt_model.rnnt_*`,
`tts_model.tts_model.*`, `tts_model.audio_prompt_latents.<speaker>`, `tts_model.codec_silence_tokens`,
`tts_model._control_codes`, `tts_model.audio_codec.*`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from nemo_duplex.models import rng
from nemo_duplex.models.codec_model import RVQCodec
from nemo_duplex.models.config import ModelConfig, SamplingParams, torch_dtype
from nemo_duplex.models.encoder import Perception
from nemo_duplex.models.fp8_weights import LLM_PROJECTIONS, TALKER_PROJECTIONS, quantize_projections
from nemo_duplex.models.llm import NemotronH
from nemo_duplex.models.rnnt import RNNTDecoder, RNNTJoint, rnnt_greedy_decode
from nemo_duplex.models.sampling import sample_text
from nemo_duplex.models.stacking import stack_all
from nemo_duplex.models.talker import EarTTS


class STTModel(nn.Module):
    """Perception + Nemotron-H + embeddings and heads (+ the auxiliary RNN-T head)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.perception = Perception(cfg.frontend, cfg.encoder)
        if cfg.rnnt.present:
            self.rnnt_decoder = RNNTDecoder(cfg.rnnt)
            self.rnnt_joint = RNNTJoint(cfg.rnnt, cfg.encoder.d_model)
        self.llm = NemotronH(cfg.llm)
        self.embed_tokens = nn.Embedding(cfg.llm.vocab_size, cfg.llm.hidden_size)
        self.lm_head = nn.Linear(cfg.llm.hidden_size, cfg.llm.vocab_size, bias=False)
        if cfg.llm.use_function_head:
            self.function_head = nn.Linear(cfg.llm.hidden_size, cfg.llm.vocab_size, bias=False)


class TTSModel(nn.Module):
    """EAR-TTS talker + speaker latents + codec."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t = cfg.talker
        self.tts_model = EarTTS(t, cfg.llm.vocab_size)
        self.audio_prompt_latents = nn.ParameterDict({
            t.speaker: nn.Parameter(torch.zeros(1, cfg.prompt_frames, t.backbone.hidden_size))})
        self.register_buffer("codec_silence_tokens", torch.zeros(t.num_quantizers, dtype=torch.int64))
        cb = t.codebook_size  # control codes: [speech-bos, speech-eos, speech-pad] (spec 6.3)
        self.register_buffer("_control_codes", torch.tensor([cb + 2, cb + 1, cb], dtype=torch.int64))
        self.audio_codec = RVQCodec(cfg.codec)


class VoiceChat(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.stt_model = STTModel(cfg)
        self.tts_model = TTSModel(cfg)

    # ---- parts, by what they are -------------------------------------------------------------------
    @property
    def perception(self) -> Perception:
        return self.stt_model.perception

    @property
    def llm(self) -> NemotronH:
        return self.stt_model.llm

    @property
    def talker(self) -> EarTTS:
        return self.tts_model.tts_model

    @property
    def codec(self) -> RVQCodec:
        return self.tts_model.audio_codec

    @property
    def has_function_head(self) -> bool:
        return self.cfg.llm.use_function_head

    @property
    def has_rnnt(self) -> bool:
        return self.cfg.rnnt.present

    def speaker_latent(self, speaker: str | None = None) -> torch.Tensor:
        name = speaker or self.cfg.talker.speaker
        if name not in self.tts_model.audio_prompt_latents:
            raise KeyError(f"unknown speaker {name!r}; this checkpoint has "
                           f"{sorted(self.tts_model.audio_prompt_latents.keys())}")
        return self.tts_model.audio_prompt_latents[name]

    @property
    def silence_codes(self) -> torch.Tensor:
        return self.tts_model.codec_silence_tokens

    # ---- set-up --------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Seeded random weights for tests and benchmarks (speed does not depend on weight values)."""
        self.perception.init_weights(generator)
        if self.has_rnnt:
            self.stt_model.rnnt_decoder.init_weights(generator)
            self.stt_model.rnnt_joint.init_weights(generator)
        self.llm.init_weights(generator)
        h = self.cfg.llm.hidden_size
        for lin in [self.stt_model.embed_tokens, self.stt_model.lm_head] + (
                [self.stt_model.function_head] if self.has_function_head else []):
            w = torch.randn(lin.weight.shape, generator=generator, device=generator.device) * (1.0 if lin is self.stt_model.embed_tokens
                                                                     else h ** -0.5)
            lin.weight.copy_(w)
        self.talker.init_weights(generator)
        for p in self.tts_model.audio_prompt_latents.values():
            p.copy_(torch.randn(p.shape, generator=generator, device=generator.device))
        self.codec.init_weights(generator)

    def set_vocab(self, tokenizer) -> None:
        """Tokenizer-derived talker tables (continuation flags, BOS/EOS flags, characters per token)."""
        t = self.cfg.tokens
        strings = tokenizer.token_strings()
        strings = strings + [""] * (self.cfg.llm.vocab_size - len(strings))
        self.talker.set_vocab(strings, t.bos_id, t.eos_id)

    def cast_for_inference(self, quantize: bool = True) -> "VoiceChat":
        """Per-part compute dtypes from config (spec 1.6: codec always fp32; SSM state dtype is separate).
        `quantize=False` leaves the projections that `dtype.llm_weights` / `talker_weights` turn into float8 as
        nn.Linear for weights still to come (checkpoint.load.build_empty_model); the cast after loading quantises
        them from the loaded values."""
        d = self.cfg.dtype
        self.perception.to(torch_dtype(d.encoder))
        self.perception.preprocessor.float()  # mel features in fp32 always (spec 9.10)
        if self.has_rnnt:
            self.stt_model.rnnt_decoder.to(torch_dtype(d.encoder))
            self.stt_model.rnnt_joint.to(torch_dtype(d.encoder))
        if quantize:   # from the loaded values, before the casts (Fp8Linear keeps e4m3)
            if d.llm_weights:
                quantize_projections(self.llm, LLM_PROJECTIONS, d.llm_weights,
                                     f"model.dtype.llm_weights={d.llm_weights}")
            if d.talker_weights:
                quantize_projections(self.talker.backbone, TALKER_PROJECTIONS, d.talker_weights,
                                     f"model.dtype.talker_weights={d.talker_weights}")
        for m in [self.llm, self.stt_model.embed_tokens, self.stt_model.lm_head] + (
                [self.stt_model.function_head] if self.has_function_head else []):
            m.to(torch_dtype(d.llm))
        self.talker.to(torch_dtype(d.talker))
        self.tts_model.audio_prompt_latents.to(torch_dtype(d.talker))
        self.codec.float()
        # after the casts, which would give each weight its own copy again: the talker's projections, the
        # LLM attention layers' q/k/v (one GEMM each)
        stack_all(self.talker)
        stack_all(self.llm)
        if self.has_rnnt:
            self.stt_model.rnnt_joint.pad_output()
        # the LLM step's path, chosen here once: the Triton kernels where the weights are on CUDA
        self.llm.use_kernels = self.stt_model.embed_tokens.weight.is_cuda
        if not self.talker.bos_emb.is_meta:   # (build_empty_model casts on meta, before any weight exists)
            self.talker.build_tables()
            self.codec.presplit_weights()  # after the codec's cast: its GEMM weights split once, where used
        return self

    # ---- the channel fusion (spec 1.3) ---------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.stt_model.embed_tokens(ids)

    def fuse(self, source: torch.Tensor, prev_text: torch.Tensor, prev_func: torch.Tensor,
             text_weight: torch.Tensor | float | None = None) -> torch.Tensor:
        """source [..., H] (perception frame or prompt-token embedding) + E(prev text) + E(prev function).
        Floating-point order user -> text -> function, as NeMo (it matters for bit-exactness)."""
        c = self.cfg
        wt = c.text_channel_weight if text_weight is None else text_weight
        x = source * c.user_channel_weight
        x = x + self.embed(prev_text) * wt
        if self.has_function_head:
            x = x + self.embed(prev_func) * c.function_channel_weight
        return x

    def prompt_embeddings(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """Fused LLM inputs for the P system-prompt positions [P, H]: prompt tokens ride the user-audio
        channel, text and function channels are PAD; position 0 adds E(PAD) with weight 1 (spec 1.3)."""
        pad = torch.full_like(prompt_ids, self.cfg.tokens.pad_id)
        wt = torch.full((prompt_ids.shape[0], 1), self.cfg.text_channel_weight, device=prompt_ids.device)
        wt[0] = 1.0
        return self.fuse(self.embed(prompt_ids), pad, pad, text_weight=wt.to(self.stt_model.embed_tokens.weight.dtype))

    def heads(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        text_logits = self.stt_model.lm_head(h)
        func_logits = self.stt_model.function_head(h) if self.has_function_head else None
        return text_logits, func_logits

    def prompt_ids(self, tokenizer, prompt: str | None) -> torch.Tensor | None:
        """[bos] + encode(prompt) + [eos] (spec 1.3), or None for no prompt."""
        if not prompt:
            return None
        t = self.cfg.tokens
        ids = [t.bos_id] + tokenizer.encode(prompt) + [t.eos_id]
        return torch.tensor(ids, dtype=torch.int64, device=self.stt_model.embed_tokens.weight.device)


@dataclass
class ClipResult:
    """Per-frame outputs on the audio timeline (prompt region stripped), plus the agent waveform."""
    encoder_out: torch.Tensor      # [T, d_enc] before projection
    audio_embeds: torch.Tensor     # [T, d_llm]
    text_tokens: torch.Tensor      # [T] int64
    function_tokens: torch.Tensor  # [T] int64
    text_logits_top2: torch.Tensor  # [T, 2] top-1 and top-2 text logit values
    codes: torch.Tensor            # [T, Q] int64
    wav: torch.Tensor              # [samples] float32 at 22.05 kHz
    user_tokens: list[int]         # RNN-T user transcript token ids

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"encoder_out": self.encoder_out.float(), "audio_embeds": self.audio_embeds.float(),
                "text_tokens": self.text_tokens, "function_tokens": self.function_tokens,
                "text_logits_top2": self.text_logits_top2.float(), "codes": self.codes,
                "wav": self.wav.float()}


def _user_transcript(model: VoiceChat, enc: torch.Tensor) -> list[int]:
    if not model.has_rnnt:
        return []
    return rnnt_greedy_decode(model.stt_model.rnnt_decoder, model.stt_model.rnnt_joint, enc)


@torch.no_grad()
def offline_inference(model: VoiceChat, audio: torch.Tensor, prompt_ids: torch.Tensor | None = None,
                      seed: int = 0, sampling: SamplingParams | None = None) -> ClipResult:
    """NVIDIA's `NemotronVoiceChat.offline_inference` (spec 7.1): perception over the whole clip
    (K+1 frames for K*1280 samples), the LLM re-run over the whole fused history at every step (no
    cache), frame 0's codes all zero and never generated, the talker stepped from t = 1 through the
    prompt region too, and the codec decoding all P + T frames in one shot."""
    cfg, dev = model.cfg, model.stt_model.embed_tokens.weight.device
    sampling = sampling or SamplingParams()
    pad = cfg.tokens.pad_id
    audio = audio.to(dev, torch.float32)[None]
    enc, enc_len = model.perception(audio, torch.tensor([audio.shape[1]], device=dev))
    enc = enc[0, : int(enc_len[0])]
    a = model.perception.project(enc).to(model.stt_model.embed_tokens.weight.dtype)
    P = 0 if prompt_ids is None else prompt_ids.shape[0]
    source = a if P == 0 else torch.cat([model.embed(prompt_ids), a])
    T = source.shape[0]

    gen_text = torch.full((T,), pad, dtype=torch.int64, device=dev)
    gen_func = torch.full((T,), pad, dtype=torch.int64, device=dev)
    top2 = torch.zeros(T, 2, device=dev)
    seen = torch.zeros(1, cfg.llm.vocab_size, dtype=torch.bool, device=dev)
    special = torch.tensor([pad, cfg.tokens.bos_id, cfg.tokens.eos_id], device=dev)
    params = [torch.tensor([v], device=dev) for v in (sampling.temperature, sampling.top_p,
                                                     sampling.repetition_penalty)]
    greedy = torch.tensor([sampling.greedy], device=dev)
    seed_t = torch.tensor([seed], dtype=torch.int64, device=dev)

    # Talker: one slot (+ sink), warm-up, speech-pad previous codes (spec 4.3).
    talker, Q = model.talker, cfg.talker.num_quantizers
    kv_dtype = torch_dtype(cfg.dtype.talker_kv) if cfg.dtype.talker_kv else next(talker.parameters()).dtype
    tcache = talker.allocate_cache(2, cfg.prompt_frames + T + 1, dev, kv_dtype)
    slot = torch.zeros(1, dtype=torch.int64, device=dev)
    talker.prefill_warmup(tcache, slot, model.speaker_latent(), model.silence_codes)
    code = torch.full((1, Q), cfg.talker.speech_pad_code, dtype=torch.int64, device=dev)
    gen_codes = torch.zeros(T, Q, dtype=torch.int64, device=dev)  # frame 0 stays all-zero (spec 9.13)
    n_passes = model.talker.num_passes

    inputs = []
    for t in range(T):
        prev_text = torch.full((1,), pad, device=dev, dtype=torch.int64) if t == 0 else gen_text[t - 1: t]
        prev_func = gen_func[max(t - 1, 0): max(t - 1, 0) + 1]
        wt = 1.0 if (t == 0 and P > 0) else None
        inputs.append(model.fuse(source[t: t + 1], prev_text, prev_func, text_weight=wt))
        h = model.llm(torch.cat(inputs)[None])[0, -1:]            # full replay, last position
        text_logits, func_logits = model.heads(h)
        if t >= P:                                                  # nothing is sampled in the prompt
            top2[t] = text_logits.float().topk(2, dim=-1).values[0]
            gen_text[t] = sample_text(text_logits, special, seen, *params, greedy, seed_t,
                                      torch.tensor([t - P], device=dev))[0]
            if func_logits is not None:
                gen_func[t] = func_logits.float().argmax(-1)[0]
            if gen_text[t] not in special:
                seen[0, gen_text[t]] = True
        if t >= 1:
            step = torch.tensor([t - 1], dtype=torch.int64, device=dev)
            u, z = rng.talker_draws(seed_t, step, n_passes, cfg.talker.mog.num_predictions, cfg.talker.latent_size)
            code = talker.step(gen_text[t: t + 1], code, tcache, slot, step + cfg.prompt_frames, u, z,
                               model.silence_codes)
            gen_codes[t] = code[0]

    wav = model.codec.decode(gen_codes[None].to(dev))[0]
    return ClipResult(encoder_out=enc, audio_embeds=a, text_tokens=gen_text[P:], function_tokens=gen_func[P:],
                      text_logits_top2=top2[P:], codes=gen_codes[P:], wav=wav,
                      user_tokens=_user_transcript(model, enc))
