"""EAR-TTS talker (MODEL_SPEC section 4): text token + previous codes -> 31 RVQ codes per frame.

`EarTTS` holds the talker's parts under the official checkpoint names (spec 6.3, prefix
`tts_model.tts_model.`): the Gemma3 backbone (gemma.py), the char-aware text conditioning and gated fusion
(text_conditioning.py) and the MoG head (mog_head.py). It implements the warm-up (spec 4.3), one step (4.4)
and the iterative RVQ decoding (4.5, 4.6). The parts stay importable from here.

Per-call state is a `TalkerCache` pool (one row per call plus a sink row, docs/design.md); every step
reads and writes only the rows named by `slots`. Random draws are inputs, never drawn here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nemo_duplex.models.config import TalkerConfig
from nemo_duplex.models.gemma import (
    GatedMLP,
    Gemma3Attention,
    Gemma3Backbone,
    Gemma3Layer,
    GemmaRMSNorm,
    TalkerCache,
    apply_rotary,
    attention_projections,
    rope_frequencies,
    rotary_cos_sin,
    talker_pool_page,
)
from nemo_duplex.models.mog_head import MoGHead, MoGLayer, residual_quantise, top_k_filter
from nemo_duplex.models.stacking import stack_all
from nemo_duplex.models.text_conditioning import (
    BOSEOSEmbedding,
    CharAwareSubwordEncoder,
    CharEncoder,
    CharEncoderAttention,
    CharEncoderLayer,
    GatedProjectedSumRMSNorm,
    SubwordFlagEmbedding,
)
from ops.codebook_sum import codebook_sum
from ops.kv_pages import kv_write
from ops.mog_latent import mog_latent
from ops.top_p_sample import gumbel, top_p_gumbel_argmax

# EarTTS and the ids, plus its parts (gemma.py, text_conditioning.py, mog_head.py), importable from here
__all__ = [
    "DEFAULT_BOS_ID", "DEFAULT_EOS_ID", "DEFAULT_PAD_ID",
    "BOSEOSEmbedding", "CharAwareSubwordEncoder", "CharEncoder", "CharEncoderAttention", "CharEncoderLayer",
    "EarTTS", "GatedMLP", "GatedProjectedSumRMSNorm", "Gemma3Attention", "Gemma3Backbone", "Gemma3Layer",
    "GemmaRMSNorm", "MoGHead", "MoGLayer", "SubwordFlagEmbedding", "TalkerCache", "apply_rotary",
    "attention_projections", "residual_quantise", "rope_frequencies", "rotary_cos_sin", "top_k_filter",
]

# Special ids of the LLM tokenizer (spec 3.8); `EarTTS.set_vocab` overrides them with the loaded tokenizer's.
DEFAULT_BOS_ID, DEFAULT_EOS_ID, DEFAULT_PAD_ID = 1, 2, 12


class EarTTS(nn.Module):
    """`tts_model.tts_model.*` of the checkpoint (spec 4, keys 6.3)."""
    DERIVED_TABLES = ("text_table", "rvq_table", "rvq_books", "rvq_norms")   # build_tables

    def __init__(self, cfg: TalkerConfig, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        hidden = cfg.backbone.hidden_size
        self.backbone = Gemma3Backbone(cfg.backbone)
        self.embed_code = nn.Linear(cfg.latent_size, hidden, bias=False)
        self.bos_emb = nn.Parameter(torch.zeros(hidden))
        self.null_emb = nn.Parameter(torch.zeros(hidden))
        # frozen projection used only to build a latent from prompt audio; the stored speaker latent replaces it
        self.audio_prompt_projection_W = nn.Parameter(torch.zeros(hidden, hidden))
        self.rvq_embs = nn.Parameter(torch.zeros(cfg.num_quantizers, cfg.codebook_size, cfg.latent_size))
        self.embed_subword = CharAwareSubwordEncoder(cfg.cas, vocab_size, hidden)
        self.gated_fusion_audio_text = GatedProjectedSumRMSNorm(hidden, cfg.num_quantizers, cfg.backbone.rms_norm_eps)
        self.mog_head = MoGHead(cfg.mog, hidden, cfg.latent_size)
        self.bos_id, self.eos_id, self.pad_id = DEFAULT_BOS_ID, DEFAULT_EOS_ID, DEFAULT_PAD_ID
        self.vocab_is_set = False
        # codebooks filled by each effective MoG pass (spec 4.6): [1, 1, 3, 4, 22] at 31
        self.pass_sizes = [k for k in cfg.unmask_schedule() if k > 0]
        # Tables derived from the weights (build_tables; not in the state_dict, empty until built):
        #   text_table  text_condition of every token id [vocab, H]
        #   rvq_table   code_table() [Q * (codebook + 1), latent]
        #   rvq_books   the codebooks in fp32 [Q, codebook, latent], rvq_norms their squared norms [Q, codebook]
        for name in self.DERIVED_TABLES:
            self.register_buffer(name, torch.empty(0), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.weights_loaded())

    @property
    def num_passes(self) -> int:
        return len(self.pass_sizes)

    def stack_projections(self) -> None:
        """Every Gemma attention's q/k/v and every gated MLP's gate/up (backbone, MoG trunk, char encoder)
        as one GEMM each (`stack_linears`): 100 fewer GEMMs per frame step at full size (census), and the MoG
        head's logits / else projections (5 more). Call it once the weights are on their device in their dtype
        (VoiceChat.cast_for_inference does)."""
        stack_all(self)

    # --- tokenizer tables ------------------------------------------------------------------------------

    def set_vocab(self, id_to_token: list[str], bos_id: int, eos_id: int, pad_id: int = DEFAULT_PAD_ID) -> None:
        """Flag buffers and the char table from the tokenizer's token strings (spec 4.2.2)."""
        if len(id_to_token) != self.vocab_size:
            raise ValueError(f"tokenizer has {len(id_to_token)} tokens, the talker was built for {self.vocab_size}")
        device = self.embed_subword.char_ids.device
        char_index: dict[str, int] = {}
        for token in id_to_token:  # single-character tokens in id order, densely re-indexed
            if len(token) == 1 and token not in char_index:
                char_index[token] = len(char_index)
        if len(char_index) != self.cfg.cas.num_chars:
            raise ValueError(f"tokenizer has {len(char_index)} single-character tokens, "
                             f"cas.num_chars is {self.cfg.cas.num_chars}")
        token_chars = [[char_index[ch] for ch in token if ch in char_index] for token in id_to_token]
        max_chars = max(1, max(len(chars) for chars in token_chars))
        pad_char = self.cfg.cas.num_chars
        char_ids = torch.tensor([chars + [pad_char] * (max_chars - len(chars)) for chars in token_chars], dtype=torch.long)
        char_len = torch.tensor([len(chars) for chars in token_chars], dtype=torch.long)

        continuation = [0 if token.startswith(("Ġ", "▁", "<")) else 1 for token in id_to_token] + [0]  # + pad
        special = [1 if i == bos_id else 2 if i == eos_id else 0 for i in range(self.vocab_size)]
        special[-1] = 0  # last entry is the pad slot of the table
        sub = self.embed_subword
        sub.subword_flag_emb.is_continuation.copy_(torch.tensor(continuation))
        sub.subword_flag_emb.pad_tensor.fill_(self.vocab_size)
        sub.bos_eos_emb.special_flags.copy_(torch.tensor(special))
        sub.bos_eos_emb.pad_tensor.fill_(self.vocab_size - 1)
        sub.char_ids = char_ids.to(device)
        sub.char_len = char_len.to(device)
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.vocab_is_set = True
        self.weights_loaded()   # the text table was built from the old char table

    # --- embeddings ------------------------------------------------------------------------------------

    def code_table(self) -> torch.Tensor:
        """The codebooks with a zero row appended to each, flattened: [Q * (codebook + 1), latent]."""
        q, cb, latent = self.rvq_embs.shape
        return F.pad(self.rvq_embs, (0, 0, 0, 1)).reshape(q * (cb + 1), latent)

    def depthsum(self, codes: torch.Tensor, table: torch.Tensor | None = None, repeat: int = 1) -> torch.Tensor:
        """codes [..., Q] -> sum_i rvq_embs[i][codes_i] [..., latent], summed in codebook order in fp32 (one
        kernel on the GPU, ops/codebook_sum.py); code == codebook_size (speech pad / masked) adds the appended
        zero row (spec 4.2.1). `table`: code_table(), if the caller has it. `repeat` (codes [B, Q]): the B
        rows `repeat` times over, [repeat x B, latent] (both CFG streams)."""
        table = self.rvq_tables()[0] if table is None else table
        q, latent = self.cfg.num_quantizers, table.shape[-1]
        return codebook_sum(codes, table.view(q, -1, latent), repeat)

    def embed_codes(self, codes: torch.Tensor, table: torch.Tensor | None = None, repeat: int = 1) -> torch.Tensor:
        return self.embed_code(self.depthsum(codes, table, repeat))

    def text_condition(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B] -> [B, H]: char-aware embedding + flags (mask true); a row of `text_table` once built."""
        if self.text_table.numel():
            return F.embedding(ids, self.text_table)
        return self.embed_subword(ids)

    def rvq_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(code_table(), the codebooks in fp32, their squared norms): built once (build_tables), else
        computed, the same ops either way."""
        if self.rvq_books.numel():
            return self.rvq_table, self.rvq_books, self.rvq_norms
        books = self.rvq_embs.float()
        return self.code_table(), books, books.pow(2).sum(-1)

    @torch.no_grad()
    def build_tables(self, chunk: int = 1024) -> None:
        """The tables a frame step would otherwise derive from the weights every time:
        - text_table: text_condition of every token id. It depends on the id alone (the char encoder sees
          only the token's own characters; the flags are per id), so a step looks up one row per call
          instead of running the char encoder: ~80 fewer launches per step (scripts/dev/census_step.py), for
          vocab x H values (302 MiB in bf16 at full size). Built in chunks of `chunk` ids (the char
          encoder's activations grow with the longest token's characters squared: ~1 GiB of attention
          scores per 1024 ids at 128 characters), so its values equal the char encoder's within the
          rounding of other batch shapes.
        - rvq_table, rvq_books, rvq_norms: the padded code table, the fp32 codebooks and their norms (4
          launches and ~0.3 GB of memory traffic per step at full size; 97 MiB kept), bit for bit what
          the step computed.
        All counted by memory.weight_bytes. Rebuilt after a cast or move (`_apply`); dropped when the
        weights or the tokenizer tables change (`weights_loaded`, `set_vocab`), after which the step
        derives them again until the next build (VoiceChat.cast_for_inference builds them)."""
        self.weights_loaded()
        ids = torch.arange(self.vocab_size, device=self.bos_emb.device)
        text_table = torch.cat([self.embed_subword(ids[i:i + chunk]) for i in range(0, self.vocab_size, chunk)])
        rvq_table, rvq_books, rvq_norms = self.rvq_tables()
        # detach: in fp32, .float() is the Parameter itself, which setattr would register as a parameter
        self.text_table, self.rvq_table, self.rvq_books, self.rvq_norms = (
            text_table, rvq_table, rvq_books.detach(), rvq_norms)

    def weights_loaded(self) -> None:
        """The weights were overwritten in place (checkpoint.load_state, load_state_dict): the derived
        tables are stale."""
        for name in self.DERIVED_TABLES:
            setattr(self, name, torch.empty(0, device=self.bos_emb.device))

    def _apply(self, fn, *args, **kwargs):
        built = self.text_table.numel() > 0
        out = super()._apply(fn, *args, **kwargs)
        if built:   # cast tables would be the old dtype's values rounded, not the new dtype's computation
            self.build_tables()
        return out

    def fuse(self, audio: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return self.gated_fusion_audio_text(audio, text)

    # --- warm-up (spec 4.3 with the 12.5 correction) ---------------------------------------------------

    def warmup_inputs(self, speaker_latent: torch.Tensor, silence_codes: torch.Tensor):
        """-> (x_cond [P, H], x_uncond [P, H]), P = the latent's rows (37).
        Code track: rows 0..P-2 = the stored latent, row P-1 = embed_code(depthsum(silence)) + bos_emb.
        Text track: PAD at 0..P-2, EOS at P-1; char encoding only at P-2 and P-1, flags everywhere.
        The unconditional stream replaces the whole text track by null_emb."""
        latent = speaker_latent.reshape(-1, speaker_latent.shape[-1])
        p = latent.shape[0]
        bos_row = self.embed_codes(silence_codes) + self.bos_emb
        audio = torch.cat([latent[: p - 1].to(bos_row.dtype), bos_row[None]], dim=0)
        ids = torch.full((p,), self.pad_id, dtype=torch.long, device=audio.device)
        ids[p - 1] = self.eos_id
        mask = torch.zeros(p, dtype=torch.bool, device=audio.device)
        mask[p - 2:] = True
        cond = self.embed_subword(ids, mask)
        x = self.fuse(torch.cat([audio, audio]), torch.cat([cond, self.null_emb.expand(p, -1)]))
        return x[:p], x[p:]

    def prefill_warmup(self, cache: TalkerCache, slots: torch.Tensor, speaker_latent: torch.Tensor,
                       silence_codes: torch.Tensor) -> None:
        """Write positions 0..P-1 of both streams of `slots` (the same speaker for all of them)."""
        self.write_warmup(cache, slots, *self.warmup_kv(speaker_latent, silence_codes))

    def warmup_kv(self, speaker_latent: torch.Tensor, silence_codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The warm-up's keys and values, k, v [layers, 2 streams, P, kv_heads, D]: a function of the speaker
        alone, so a server may compute them once per speaker (serving/admission_graphs.py)."""
        x_cond, x_uncond = self.warmup_inputs(speaker_latent, silence_codes)
        p = x_cond.shape[0]
        positions = torch.arange(p, device=x_cond.device).expand(2, p)
        _, kv = self.backbone.prefill(torch.stack([x_cond, x_uncond]), positions)
        return (torch.stack([k.transpose(1, 2) for k, _ in kv]), torch.stack([v.transpose(1, 2) for _, v in kv]))

    def write_warmup(self, cache: TalkerCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """warmup_kv's k, v into positions 0..P-1 of both streams of every slot in `slots`."""
        rows = torch.stack([slots, slots + cache.num_slots])[:, :, None]   # [2 streams, slots, 1]
        at = torch.arange(k.shape[2], device=k.device)
        for i in range(k.shape[0]):
            pool_k, pool_v = cache.layer_pools(i)
            kv_write(pool_k, cache.pages, rows, at, k[i][:, None])   # [2, 1, P, kv, D] to every slot
            kv_write(pool_v, cache.pages, rows, at, v[i][:, None])

    def allocate_cache(self, num_slots: int, max_len: int, device, dtype, page_len: int | None = None,
                       num_pages: int = 0) -> TalkerCache:
        """num_slots counts the sink row. With page_len: num_pages pages of page_len positions per stream
        and one more, the sink page, which every table entry names until a page is given (serving/pages.py)."""
        b = self.cfg.backbone
        rows, length, pages = num_slots, max_len, None
        if page_len is not None:
            rows, length = num_pages + 1, page_len
            per_row = -(-max_len // page_len)
            sink = torch.tensor([talker_pool_page(s, num_pages, num_pages) for s in (0, 1)], dtype=torch.int32,
                                device=device)   # each stream's
            pages = sink.repeat_interleave(num_slots)[:, None].expand(2 * num_slots, per_row).contiguous()
        shape = (b.num_hidden_layers, 2, rows, b.num_key_value_heads, length, b.head_dim)
        return TalkerCache(k=torch.zeros(shape, device=device, dtype=dtype),
                           v=torch.zeros(shape, device=device, dtype=dtype), pages=pages)

    # --- one frame (spec 4.4) --------------------------------------------------------------------------

    def step(self, text_ids: torch.Tensor, prev_codes: torch.Tensor, cache: TalkerCache, slots: torch.Tensor,
             positions: torch.Tensor, uniform: torch.Tensor, normal: torch.Tensor,
             silence_codes: torch.Tensor) -> torch.Tensor:
        """text_ids [B] (this frame's LLM token), prev_codes [B, Q], positions [B] -> codes [B, Q]."""
        b = text_ids.shape[0]
        if self.cfg.force_silence_on_eos:  # only true EOS, never PAD (spec 4.4.1)
            prev_codes = torch.where((text_ids == self.eos_id)[:, None], silence_codes[None, :], prev_codes)
        audio = self.embed_codes(prev_codes, repeat=2)  # no shift at step time; both streams' rows
        cond = self.text_condition(text_ids)
        x = self.fuse(audio, torch.cat([cond, self.null_emb.expand(b, -1)]))
        rows = torch.cat([slots, slots + cache.num_slots])  # stream-major pool rows
        h = self.backbone.step(x, torch.cat([positions, positions]), cache, rows)
        return self.generate_step(h, uniform, normal)

    # --- MoG sampling and iterative RVQ decoding (spec 4.5, 4.6, 12.8) ---------------------------------

    def guided_latent(self, h: torch.Tensor, e: torch.Tensor, noise: torch.Tensor, normal: torch.Tensor) -> torch.Tensor:
        """One MoG pass: backbone output h [2B, H] (the conditional stream's rows, then the unconditional
        one's) plus the code embedding e [2B, H] into the trunk -> z [B, latent] fp32. CFG acts on the trunk
        output (spec 4.5, pitfall 9.7), x_c + g (x_c - x_u) as one lerp (one rounding); component by
        Gumbel-max (noise [B, num_predictions] = gumbel(uniform)) over the top-p (or top-k) filtered logits;
        top-p and the latent draw each one kernel on the GPU (ops/top_p_sample.py, ops/mog_latent.py)."""
        head = self.mog_head
        x = head(h, e)
        b = x.shape[0] // 2
        x = torch.lerp(x[b:], x[:b], 1.0 + self.cfg.guidance_scale)
        logits, mu_else = head.heads(x)
        if self.cfg.top_k > 0:
            component = (top_k_filter(logits.float(), self.cfg.top_k).log_softmax(-1) + noise).argmax(-1)
        else:
            component = top_p_gumbel_argmax(logits, noise, self.cfg.top_p)
        return mog_latent(x, component, head.proj_mus.weight, head.low_mat, head.proj_logs.weight, mu_else,
                          normal, head.min_log_std, self.cfg.noise_scale)

    def generate_step(self, h: torch.Tensor, uniform: torch.Tensor, normal: torch.Tensor) -> torch.Tensor:
        """h [2B, H] (conditional stream's rows, then the unconditional one's); uniform [B, passes,
        num_predictions], normal [B, passes, latent] -> codes [B, Q]. Each pass sees all codes filled so far
        (the rest masked) and quantises a fresh z into its codebooks."""
        codes = torch.full((h.shape[0] // 2, self.cfg.num_quantizers), self.cfg.codebook_size,
                           dtype=torch.long, device=h.device)
        # once per step at most, not once per pass or per codebook: the padded table, fp32 books, their
        # norms (built once: build_tables), every pass's Gumbel draws and normal draws in the latent's dtype
        table, books, norms = self.rvq_tables()
        noise = gumbel(uniform.float())
        normal = normal.to(self.mog_head.proj_else.weight.dtype)
        start = 0
        for p, size in enumerate(self.pass_sizes):
            e = self.embed_codes(codes, table, repeat=2)
            z = self.guided_latent(h, e, noise[:, p], normal[:, p])
            # restart from z every pass: the MoG predicts the sum of the remaining codebooks (pitfall 9.8)
            codes[:, start:start + size] = residual_quantise(z, books[start:start + size], norms[start:start + size])
            start += size
        return codes

    # --- random weights --------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Seeded random values that keep activations O(1). Drawn on CPU, then copied to each tensor's device.
        Int flag buffers are drawn only when no tokenizer has set them."""
        hidden = self.cfg.backbone.hidden_size
        final_norm = f"mog_head.mlp_stack.{self.cfg.mog.num_layers}.weight"

        def randn(shape, std):
            return torch.randn(shape, generator=generator, device=generator.device) * std

        for name, param in self.named_parameters():
            shape = tuple(param.shape)
            if name.endswith(("norm.weight", "layernorm.weight")) or name == final_norm:
                value = randn(shape, 0.1)  # Gemma norms scale by (1 + w)
            elif name == "rvq_embs":
                value = randn(shape, self.cfg.latent_size ** -0.5)  # continuous draws: distinct codewords
            elif name == "mog_head.low_mat":
                value = randn(shape, self.cfg.mog.low_rank ** -0.5)
            elif name == "embed_subword.embed_tokens.weight":
                value = randn(shape, hidden ** -0.5)  # the char encoder scales its input by sqrt(hidden)
            elif name.endswith(("gate", "residual_scale")):
                value = randn(shape, 0.5)
            elif name.endswith("bias"):
                value = randn(shape, 0.02)
            elif name.endswith(("bos_emb", "null_emb", "cont_emb.weight", "special_emb.weight")):
                value = randn(shape, 1.0)
            else:  # [out, in] projections
                value = randn(shape, shape[-1] ** -0.5)
            param.copy_(value.to(param.device, param.dtype))

        if not self.vocab_is_set:
            flags = self.embed_subword.subword_flag_emb
            cont = torch.randint(0, 2, tuple(flags.is_continuation.shape), generator=generator,
                                 device=generator.device)
            cont[-1] = 0
            flags.is_continuation.copy_(cont.to(flags.is_continuation.device))
            flags.pad_tensor.fill_(self.vocab_size)
            special = self.embed_subword.bos_eos_emb
            table = torch.zeros(tuple(special.special_flags.shape), dtype=torch.long)
            table[self.bos_id], table[self.eos_id] = 1, 2
            special.special_flags.copy_(table.to(special.special_flags.device))
            special.pad_tensor.fill_(self.vocab_size - 1)
