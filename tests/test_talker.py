"""EAR-TTS talker (nemo_duplex/models/talker.py) on the tiny config, fp32, CPU.

Spec references: MODEL_SPEC 4 (talker), 6.3 (keys), 9.5-9.8 (pitfalls), 12.5 (flags), 12.8 (draws).
Tolerances are stated where they are used. One file past 500 lines on purpose: one per model part, as for the
codec and the checkpoint (tests/test_codec.py, tests/test_checkpoint.py), sharing its tiny talker fixtures."""
from __future__ import annotations

import copy
import dataclasses
import string

import pytest
import torch
import torch.nn.functional as F

from nemo_duplex.models.config import TalkerConfig, tiny_config
from nemo_duplex.models.talker import EarTTS, GemmaRMSNorm, residual_quantise, top_k_filter
from ops.top_p_sample import top_p_filter

VOCAB = tiny_config().llm.vocab_size  # 384
BOS, EOS, PAD = 1, 2, 12


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny ops: one intra-op thread avoids oversubscription on the shared 2-core machine (10x faster)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_vocab(generator: torch.Generator) -> list[str]:
    """384 tokens: specials, 96 single characters (the char vocabulary), one token of unknown characters,
    and random multi-char tokens, some starting with a word-boundary marker."""
    specials = ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, 16)]
    chars = [c for c in string.printable[:94]] + ["Ġ", "▁"]  # 94 printable non-space + 2 markers = 96
    assert len(set(chars)) == 96
    tokens = specials + chars + ["éü"]
    while len(tokens) < VOCAB:
        n = int(torch.randint(2, 9, (1,), generator=generator))
        idx = torch.randint(0, 94, (n,), generator=generator).tolist()
        word = "".join(chars[i] for i in idx)
        prefix = ["", "Ġ", "▁"][len(tokens) % 3]
        tokens.append(prefix + word)
    return tokens


def make_model(seed: int = 0, **overrides) -> EarTTS:
    cfg = copy.deepcopy(tiny_config().talker)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    model = EarTTS(cfg, VOCAB)
    g = torch.Generator().manual_seed(seed)
    model.set_vocab(tiny_vocab(torch.Generator().manual_seed(123)), BOS, EOS, PAD)
    model.init_weights(g)
    return model.eval()


def draws(b: int, model: EarTTS, seed: int):
    g = torch.Generator().manual_seed(seed)
    uniform = torch.rand(b, model.num_passes, model.cfg.mog.num_predictions, generator=g)
    normal = torch.randn(b, model.num_passes, model.cfg.latent_size, generator=g)
    return uniform, normal


# ------------------------------------------------------------------------------------------------
# checkpoint keys (spec 6.3 "Talker" table), full size on the meta device


def spec_talker_keys() -> dict[str, tuple]:
    H, I, L, HD, Q, CB, LAT = 1152, 4608, 28, 72, 31, 1024, 512
    keys = {}
    for i in range(L):
        p = f"backbone.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            keys[p + n + ".weight"] = (H,)
        for n in "qkvo":
            keys[p + f"self_attn.{n}_proj.weight"] = (H, H)
        keys[p + "self_attn.q_norm.weight"] = (HD,)
        keys[p + "self_attn.k_norm.weight"] = (HD,)
        keys[p + "mlp.gate_proj.weight"] = (I, H)
        keys[p + "mlp.up_proj.weight"] = (I, H)
        keys[p + "mlp.down_proj.weight"] = (H, I)
    keys["backbone.norm.weight"] = (H,)
    keys["embed_code.weight"] = (H, LAT)
    keys["bos_emb"] = (H,)
    keys["null_emb"] = (H,)
    keys["audio_prompt_projection_W"] = (H, H)
    keys["rvq_embs"] = (Q, CB, LAT)
    e = "embed_subword."
    keys[e + "embed_tokens.weight"] = (257, H)
    keys[e + "proj_embedding.weight"] = (H, H)
    c = e + "backbone.encoder.layers.0."
    for n in ("pre_self_attn_layernorm", "post_self_attn_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
        keys[c + n + ".weight"] = (H,)
    for n in "qkvo":
        keys[c + f"self_attn.{n}_proj.weight"] = (H, H)
    keys[c + "mlp.gate_proj.weight"] = (I, H)
    keys[c + "mlp.up_proj.weight"] = (I, H)
    keys[c + "mlp.down_proj.weight"] = (H, I)
    keys[e + "backbone.encoder.norm.weight"] = (H,)
    keys[e + "subword_flag_emb.cont_emb.weight"] = (2, H)
    keys[e + "subword_flag_emb.is_continuation"] = (131073,)
    keys[e + "subword_flag_emb.pad_tensor"] = ()
    keys[e + "bos_eos_emb.special_emb.weight"] = (3, H)
    keys[e + "bos_eos_emb.special_flags"] = (131072,)
    keys[e + "bos_eos_emb.pad_tensor"] = ()
    g = "gated_fusion_audio_text."
    for n in ("audio_proj", "text_proj"):
        keys[g + n + ".weight"] = (H, H)
        keys[g + n + ".bias"] = (H,)
    keys[g + "gate"] = (H,)
    keys[g + "residual_scale"] = ()
    keys[g + "final_norm.weight"] = (H,)
    m = "mog_head."
    for j in range(3):
        keys[m + f"mlp_stack.{j}.pre_norm.weight"] = (H,)
        keys[m + f"mlp_stack.{j}.post_norm.weight"] = (H,)
        keys[m + f"mlp_stack.{j}.mlp.gate_proj.weight"] = (I, H)
        keys[m + f"mlp_stack.{j}.mlp.up_proj.weight"] = (I, H)
        keys[m + f"mlp_stack.{j}.mlp.down_proj.weight"] = (H, I)
    keys[m + "mlp_stack.3.weight"] = (H,)
    keys[m + "proj_logits.weight"] = (1024, H)
    keys[m + "proj_mus.weight"] = (65536, H)
    keys[m + "proj_logs.weight"] = (1, H)
    keys[m + "proj_else.weight"] = (512, H)
    keys[m + "low_mat"] = (1024, 512, 64)
    return keys


def test_state_dict_matches_spec_keys_full_size():
    with torch.device("meta"):
        model = EarTTS(TalkerConfig(), 131072)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    want = spec_talker_keys()
    assert set(got) == set(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    bad = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not bad, bad
    sd = model.state_dict()
    for k in ("is_continuation", "special_flags", "pad_tensor"):
        assert all(sd[n].dtype == torch.int64 for n in sd if n.endswith(k))


# ------------------------------------------------------------------------------------------------
# backbone against transformers' Gemma3


def hf_gemma3(model: EarTTS, *, full_theta=1e6, local_theta=1e4, query_pre_attn_scalar=None, sliding_window=None):
    from transformers import Gemma3TextConfig, Gemma3TextModel

    b = model.cfg.backbone
    config = Gemma3TextConfig(
        vocab_size=16, hidden_size=b.hidden_size, intermediate_size=b.intermediate_size,
        num_hidden_layers=b.num_hidden_layers, num_attention_heads=b.num_attention_heads,
        num_key_value_heads=b.num_key_value_heads, head_dim=b.head_dim,
        query_pre_attn_scalar=int(query_pre_attn_scalar or b.query_pre_attn_scalar),
        sliding_window=sliding_window or b.sliding_window,
        layer_types=["full_attention" if b.is_full_attention(i) else "sliding_attention" for i in range(b.num_hidden_layers)],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": full_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
        rms_norm_eps=b.rms_norm_eps, hidden_activation="gelu_pytorch_tanh", attention_bias=False,
        attn_implementation="eager")
    hf = Gemma3TextModel(config).eval()
    missing, unexpected = hf.load_state_dict(model.backbone.state_dict(), strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected, (missing, unexpected)
    return hf


def run_hf(hf, x):
    positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    with torch.no_grad():
        return hf(inputs_embeds=x, position_ids=positions).last_hidden_state


@pytest.fixture(scope="module")
def backbone_case():
    model = make_model()
    x = torch.randn(2, 80, model.cfg.backbone.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(80)[None].expand(2, -1)
    with torch.no_grad():
        ours = model.backbone(x, positions)
    return model, x, ours


def test_backbone_matches_transformers_gemma3(backbone_case):
    """HF config: rope_theta 1e6 on full layers (layer 5), rope_local_base_freq 1e4 on sliding ones,
    query_pre_attn_scalar 256, sliding_window 48 (< 80 positions), eager attention."""
    model, x, ours = backbone_case
    assert [l.self_attn.rope_theta for l in model.backbone.layers] == [1e4] * 5 + [1e6]
    ref = run_hf(hf_gemma3(model), x)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["swapped_theta", "same_theta", "scale_head_dim", "no_window"])
def test_backbone_pitfall_variants_are_detected(backbone_case, variant):
    """Pitfall 9.6: each wrong choice moves HF's output far beyond the 1e-4 tolerance of the test above,
    so that test would fail for an implementation that made it."""
    model, x, ours = backbone_case
    kwargs = {"swapped_theta": dict(full_theta=1e4, local_theta=1e6), "same_theta": dict(full_theta=1e4),
              "scale_head_dim": dict(query_pre_attn_scalar=model.cfg.backbone.head_dim),
              "no_window": dict(sliding_window=10_000)}[variant]
    ref = run_hf(hf_gemma3(model, **kwargs), x)
    assert (ours - ref).abs().max() > 1e-2


def test_gemma_norm_is_one_plus_weight(backbone_case, monkeypatch):
    """(1 + w) in fp32 (pitfall 9.6); a plain-w norm is caught by the HF comparison."""
    norm = GemmaRMSNorm(8)
    norm.weight.data = torch.randn(8)
    x = torch.randn(3, 8)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight)
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-5)

    model, x, ours = backbone_case
    ref = run_hf(hf_gemma3(model), x)

    def plain(self, t):
        tf = t.float()
        return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).type_as(t)

    monkeypatch.setattr(GemmaRMSNorm, "forward", plain)
    with torch.no_grad():
        wrong = model.backbone(x, torch.arange(80)[None].expand(2, -1))
    assert (wrong - ref).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------
# cached per-token step == full-sequence forward


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.triton_interpret)])
def test_cached_step_matches_full_forward(kernels):
    """Three calls in slots of both streams start at different frames; every batch also has padding rows
    writing into the sink slot at arbitrary positions. Tolerance: atol 2e-5, rtol 1e-4 (fp32). With
    `kernels` the norm kernels run through the interpreter (the step's fused add + norm joints against
    prefill's separate norms).

    The backbone is cut to its two kinds of layer (one sliding, one full: sliding_window_pattern 2) with a
    5-position window (the tiny model's is 48), so that T = 8 frames cross it: every step of every layer's
    decode attention kernel goes through the interpreter. A pool of 64 positions still gives the kernel two
    splits per row (the merge of partial results runs; the sink rows' random positions span several blocks)."""
    model = make_model(backbone=dataclasses.replace(tiny_config().talker.backbone, num_hidden_layers=2,
                                                    sliding_window_pattern=2, sliding_window=5))
    assert [layer.self_attn.window for layer in model.backbone.layers] == [5, None]
    H, T, S, L = model.cfg.backbone.hidden_size, 8, 4, 64  # T > sliding window 5
    g = torch.Generator().manual_seed(2)
    xs = torch.randn(3, T, H, generator=g)
    positions = torch.arange(T)[None].expand(3, -1)
    with torch.no_grad():
        full, kv = model.backbone.prefill(xs, positions)
    cache = model.allocate_cache(S, L, "cpu", torch.float32)
    rows_of = [2, S + 0, S + 1]  # pool rows (stream * S + slot); slot 3 is the sink
    starts = [0, 2, 5]
    out = torch.zeros_like(full)
    with torch.no_grad():
        for step in range(max(starts) + T):
            rows, pos, xin, who = [], [], [], []
            for c in range(3):
                t = step - starts[c]
                if 0 <= t < T:
                    rows.append(rows_of[c]); pos.append(t); xin.append(xs[c, t]); who.append((c, t))
            for sink_row in (3, S + 3):  # padding rows of both streams
                rows.append(sink_row); pos.append(int(torch.randint(0, L, (1,), generator=g)))
                xin.append(10 * torch.randn(H, generator=g))
            h = model.backbone.step(torch.stack(xin), torch.tensor(pos), cache, torch.tensor(rows))
            for i, (c, t) in enumerate(who):
                out[c, t] = h[i]
    torch.testing.assert_close(out, full, atol=2e-5, rtol=1e-4)
    for layer, (k, v) in enumerate(kv):
        pool_k, pool_v = cache.layer_pools(layer)
        for c, row in enumerate(rows_of):
            torch.testing.assert_close(pool_k[row, :, :T], k[c], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(pool_v[row, :, :T], v[c], atol=1e-5, rtol=1e-5)
    assert pool_k[0].abs().max() == 0 and pool_k[1].abs().max() == 0  # untouched slots stay untouched


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.triton_interpret)])
def test_stacked_projections_compute_the_separate_ones(kernels):
    """stack_projections (one GEMM for each attention's q/k/v and each gated MLP's gate/up): the weights
    become views of the stacks (no second copy; loading a state_dict writes into them), and a backbone
    step, a prefill and a whole talker step give what the separate projections give: hidden states within
    1e-5 (fp32; the stacked GEMM may sum in another order), codes identical. A cast afterwards (which
    gives each weight a tensor of its own) re-stacks. With `kernels`, the norm + rotary and gelu * up
    kernels read the stacked GEMM's column views (interpreter). The backbone has one layer of each kind
    (sliding, full): every stacked module of the talker, fewer steps through the interpreter."""
    from nemo_duplex.models.stacking import StackedProjections

    def step_outputs(model):
        g = torch.Generator().manual_seed(4)
        H, S = model.cfg.backbone.hidden_size, 3
        cache = model.allocate_cache(S, 16, "cpu", torch.get_default_dtype())
        with torch.no_grad():
            full, _ = model.backbone.prefill(torch.randn(2, 5, H, generator=g), torch.arange(5)[None].expand(2, -1))
            h = model.backbone.step(torch.randn(4, H, generator=g), torch.tensor([0, 3, 7, 2]), cache,
                                    torch.tensor([0, 1, S, S + 1]))
            uniform, normal = draws(2, model, 5)
            codes = model.step(torch.tensor([150, EOS]), torch.randint(0, 64, (2, 31), generator=g), cache,
                               torch.tensor([1, 0]), torch.tensor([8, 9]), uniform, normal,
                               torch.randint(0, 64, (31,), generator=g))
        return full, h, cache.k, codes

    def views_of_stack(module):  # every stacked weight is its block of the module's stack
        row = 0
        for name in module.stacked:
            w = getattr(module, name).weight
            if w.untyped_storage().data_ptr() != module.stack.untyped_storage().data_ptr():
                return False
            if not torch.equal(module.stack[row: row + w.shape[0]], w) or w.data_ptr() != module.stack[row].data_ptr():
                return False
            row += w.shape[0]
        return row == module.stack.shape[0]

    def compare(a, b):
        got, want = step_outputs(a), step_outputs(b)
        for x, y in zip(got[:3], want[:3]):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        assert torch.equal(got[3], want[3])

    two_layers = dataclasses.replace(tiny_config().talker.backbone, num_hidden_layers=2, sliding_window_pattern=2)
    separate = make_model(backbone=two_layers)
    stacked = copy.deepcopy(separate)
    stacked.stack_projections()
    parts = [m for m in stacked.modules() if isinstance(m, StackedProjections)]
    # + the MoG head's logits / else projections, + the char encoder
    assert len(parts) == 2 * stacked.cfg.backbone.num_hidden_layers + stacked.cfg.mog.num_layers + 2
    assert all(views_of_stack(m) for m in parts)
    storages = {p.untyped_storage().data_ptr() for p in stacked.parameters()}
    assert len(storages) == len(list(stacked.parameters())) - sum(len(m.stacked) - 1 for m in parts)  # no copies
    compare(stacked, separate)
    other = make_model(seed=1, backbone=two_layers)
    stacked.load_state_dict(other.state_dict())  # writes into the stacks
    assert all(views_of_stack(m) for m in parts)
    compare(stacked, other)
    stacked.double()  # a cast: every module re-stacks from its cast weights
    assert all(views_of_stack(m) and m.stack.dtype == torch.float64 for m in parts)
    torch.set_default_dtype(torch.float64)
    try:
        compare(stacked, other.double())
    finally:
        torch.set_default_dtype(torch.float32)


# ------------------------------------------------------------------------------------------------
# tokenizer tables and the char-aware encoder


def test_set_vocab_tables():
    model = make_model()
    tokens = tiny_vocab(torch.Generator().manual_seed(123))
    sub = model.embed_subword
    assert sub.subword_flag_emb.is_continuation.tolist() == \
        [0 if t[0] in "Ġ▁<" else 1 for t in tokens] + [0]
    flags = sub.bos_eos_emb.special_flags.tolist()
    assert flags[BOS] == 1 and flags[EOS] == 2 and sum(flags) == 3
    chars = [t for t in tokens if len(t) == 1]
    index = {c: i for i, c in enumerate(chars)}
    for tid in (BOS, PAD, 20, 113, 200, 383):
        want = [index[c] for c in tokens[tid] if c in index]
        n = int(sub.char_len[tid])
        assert sub.char_ids[tid, :n].tolist() == want and n == len(want)
        assert (sub.char_ids[tid, n:] == 96).all()
    assert sub.char_len[tokens.index("éü")] == 0
    bad = copy.deepcopy(tokens)
    bad[300] = "€"  # a 97th single-character token
    with pytest.raises(ValueError):
        model.set_vocab(bad, BOS, EOS, PAD)


def hf_t5gemma_encoder(model, softcap):
    from transformers.models.t5gemma.configuration_t5gemma import T5GemmaConfig
    from transformers.models.t5gemma.modeling_t5gemma import T5GemmaEncoder

    c = model.cfg.cas
    module_cfg = dict(vocab_size=c.num_chars + 1, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                      query_pre_attn_scalar=int(c.query_pre_attn_scalar), attn_logit_softcapping=softcap,
                      rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta}, rms_norm_eps=c.rms_norm_eps,
                      hidden_activation="gelu_pytorch_tanh", attn_implementation="eager")
    config = T5GemmaConfig(encoder=module_cfg, decoder=module_cfg)
    config.encoder._attn_implementation = "eager"  # sdpa would silently drop the soft-capping
    hf = T5GemmaEncoder(config.encoder).eval()
    assert hf.config._attn_implementation == "eager"
    missing, unexpected = hf.load_state_dict(model.embed_subword.backbone["encoder"].state_dict(), strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected
    return hf


def test_char_encoder_matches_transformers_t5gemma():
    """One T5Gemma encoder layer (bidirectional, softcap 50, query_pre_attn_scalar 256, RoPE 1e4, key
    padding) on char-padded tokens; rows compared only at valid chars. Tolerance atol/rtol 1e-4.
    q_proj is scaled up so that attention logits reach the soft-capping range (a missing cap shows)."""
    model = make_model()
    enc = model.embed_subword.backbone["encoder"]
    with torch.no_grad():
        enc.layers[0].self_attn.q_proj.weight.mul_(8.0)
    ids = torch.tensor([20, 113, 200, 383, 300])
    sub = model.embed_subword
    chars, lengths = sub.char_ids[ids], sub.char_len[ids]
    valid = torch.arange(chars.shape[1])[None] < lengths[:, None]
    x = sub.embed_tokens(chars)
    with torch.no_grad():
        ours = enc(x, valid)
        ref = hf_t5gemma_encoder(model, 50.0)(inputs_embeds=x, attention_mask=valid.long()).last_hidden_state
        uncapped = hf_t5gemma_encoder(model, None)(inputs_embeds=x, attention_mask=valid.long()).last_hidden_state
    torch.testing.assert_close(ours[valid], ref[valid], atol=1e-4, rtol=1e-4)
    assert (ours[valid] - uncapped[valid]).abs().max() > 1e-2
    # pooled embedding: masked mean over valid chars, then proj_embedding
    with torch.no_grad():
        pooled = (ref * valid[..., None]).sum(1) / lengths[:, None]
        torch.testing.assert_close(sub.encode_chars(ids), sub.proj_embedding(pooled), atol=1e-4, rtol=1e-4)


def test_token_without_known_chars_gives_flags_only():
    model = make_model()
    tid = torch.tensor([tiny_vocab(torch.Generator().manual_seed(123)).index("éü")])  # no known character
    sub = model.embed_subword
    with torch.no_grad():
        emb = model.text_condition(tid)
    flags = sub.subword_flag_emb.cont_emb.weight[1] + sub.bos_eos_emb.special_emb.weight[0]
    torch.testing.assert_close(emb[0], flags, atol=1e-6, rtol=1e-6)


def test_text_table_matches_the_char_encoder():
    """EarTTS.build_tables: text_condition looks up one row per id; the reference is the char
    encoder run on the ids themselves (fp32; the table is built here in chunks of 100 ids, the last one
    partial, the reference on a batch of 33: the same ops on other batch shapes, so equal within fp32
    rounding, atol/rtol 1e-6). Every id, fresh random ones and the special ones."""
    model = make_model(seed=7)
    g = torch.Generator().manual_seed(11)
    ids = torch.cat([torch.randint(0, VOCAB, (30,), generator=g), torch.tensor([BOS, EOS, PAD])])
    with torch.no_grad():
        reference = model.embed_subword(ids)
        model.build_tables(chunk=100)
        assert model.text_table.shape == (VOCAB, model.cfg.backbone.hidden_size)
        torch.testing.assert_close(model.text_condition(ids), reference, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(model.text_table, model.embed_subword(torch.arange(VOCAB)), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rvq_tables_change_no_code_and_no_checkpoint_key(dtype):
    """build_tables' code table, fp32 codebooks and norms are what generate_step derived every step, by
    the same ops: the codes are equal bit for bit with and without them (fresh random trunk inputs and
    draws, fp32 and bf16 weights), and none of the tables is a checkpoint key (in fp32, .float() of a
    parameter is the parameter itself)."""
    model = make_model(seed=5).to(dtype)
    keys = set(model.state_dict())
    g = torch.Generator().manual_seed(21)
    h = model.cfg.backbone.hidden_size
    h_cond, h_uncond = (torch.randn(6, h, generator=g).to(dtype) for _ in range(2))
    uniform, normal = draws(6, model, seed=22)
    with torch.no_grad():
        derived = model.generate_step(torch.cat([h_cond, h_uncond]), uniform, normal)
        model.build_tables()
        assert model.rvq_books.numel() and set(model.state_dict()) == keys
        assert not any(p is model.rvq_books for p in model.parameters())
        built = model.generate_step(torch.cat([h_cond, h_uncond]), uniform, normal)
    assert torch.equal(derived, built)


def test_text_table_follows_the_weights_and_the_vocab():
    """The table is derived: a cast rebuilds it in the new dtype (not the old values rounded); loading
    weights (load_state_dict, checkpoint.load_state's weights_loaded) or a new char table (set_vocab)
    drops it, and text_condition runs the char encoder on the new weights."""
    model = make_model(seed=7)
    ids = torch.arange(0, VOCAB, 5)
    with torch.no_grad():
        model.build_tables()
        model.double()
        assert model.text_table.dtype == torch.float64
        torch.testing.assert_close(model.text_condition(ids), model.embed_subword(ids), atol=1e-12, rtol=1e-12)
        model.float()
        other = make_model(seed=8)
        model.load_state_dict(other.state_dict())
        assert model.text_table.numel() == 0
        torch.testing.assert_close(model.text_condition(ids), other.embed_subword(ids), atol=0, rtol=0)
        model.build_tables()
        model.weights_loaded()
        assert model.text_table.numel() == 0
        model.build_tables()
        model.set_vocab(tiny_vocab(torch.Generator().manual_seed(124)), BOS, EOS, PAD)
        assert model.text_table.numel() == 0
        torch.testing.assert_close(model.text_condition(ids), model.embed_subword(ids), atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------
# warm-up (spec 4.3 with 12.5)


def manual_fuse(model, audio, text):
    f = model.gated_fusion_audio_text
    g = torch.sigmoid(f.gate)
    h = torch.sigmoid(f.residual_scale) * (g * f.audio_proj(audio / 31) + (1 - g) * f.text_proj(text))
    return f.final_norm(h)


def manual_flags(model, tid):
    sub = model.embed_subword
    return (sub.subword_flag_emb.cont_emb.weight[sub.subword_flag_emb.is_continuation[tid]]
            + sub.bos_eos_emb.special_emb.weight[sub.bos_eos_emb.special_flags[tid]])


def test_warmup_inputs_follow_spec():
    model = make_model()
    H, P = model.cfg.backbone.hidden_size, 37
    g = torch.Generator().manual_seed(3)
    latent = torch.randn(1, P, H, generator=g)
    silence = torch.randint(0, model.cfg.codebook_size, (31,), generator=g)
    with torch.no_grad():
        x_cond, x_uncond = model.warmup_inputs(latent, silence)
        depthsum = sum(model.rvq_embs[i, silence[i]] for i in range(31))
        audio = torch.cat([latent[0, :36], (model.embed_code(depthsum) + model.bos_emb)[None]])
        sub = model.embed_subword
        pad_chars = sub.encode_chars(torch.tensor([PAD]))[0]
        eos_chars = sub.encode_chars(torch.tensor([EOS]))[0]
        text = torch.stack([manual_flags(model, PAD)] * 35 + [pad_chars + manual_flags(model, PAD),
                                                              eos_chars + manual_flags(model, EOS)])
        want_cond = manual_fuse(model, audio, text)
        want_uncond = manual_fuse(model, audio, model.null_emb.expand(P, H))
        torch.testing.assert_close(x_cond, want_cond, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x_uncond, want_uncond, atol=1e-5, rtol=1e-5)
        # the other ways differ: no flags at masked rows (12.5), PAD at 36 (MLX), chars everywhere
        no_flags = text.clone()
        no_flags[:35] = 0
        assert (manual_fuse(model, audio, no_flags) - x_cond)[:35].abs().max() > 1e-2
        pad_last = text.clone()
        pad_last[36] = pad_chars + manual_flags(model, PAD)
        assert (manual_fuse(model, audio, pad_last) - x_cond)[36].abs().max() > 1e-2
        chars_everywhere = text + torch.cat([pad_chars.expand(35, H), torch.zeros(2, H)])
        assert (manual_fuse(model, audio, chars_everywhere) - x_cond)[:35].abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------
# generate_step (spec 4.5, 4.6, 12.8)


def spec_generate_step(model, h_c, h_u, uniform, normal, *, cfg_on="trunk", restart=True):
    """Straight transcription of spec 4.6 with per-codebook loops and brute-force nearest codewords.
    Variants: cfg_on="hidden" (guidance on the backbone output), "logits" (guidance on logits only,
    mean from the conditional trunk); restart=False carries the residual across passes."""
    cfg, mog = model.cfg, model.mog_head
    B, Q, CB = h_c.shape[0], cfg.num_quantizers, cfg.codebook_size
    assert cfg.unmask_schedule() == [0, 0, 0, 1, 1, 3, 4, 22]
    codes = torch.full((B, Q), CB)
    books = F.pad(model.rvq_embs, (0, 0, 0, 1))
    cnt, p, carry = 0, 0, None
    for k in cfg.unmask_schedule():
        if k == 0:
            continue
        e = model.embed_code(sum(books[i][codes[:, i]] for i in range(Q)))
        hc, hu = h_c, h_u
        if cfg_on == "hidden":
            hc = hu = h_c + cfg.guidance_scale * (h_c - h_u)
        xc, xu = mog.mlp_stack(e + hc), mog.mlp_stack(e + hu)
        x = xc + cfg.guidance_scale * (xc - xu) if cfg_on == "trunk" else xc
        logits = mog.proj_logits(x)
        if cfg_on == "logits":
            lc, lu = mog.proj_logits(xc), mog.proj_logits(xu)
            logits = lc + cfg.guidance_scale * (lc - lu)
        from transformers.generation.logits_process import TopPLogitsWarper
        logits = TopPLogitsWarper(cfg.top_p)(None, logits)
        u = uniform[:, p]
        comp = (logits.log_softmax(-1) - torch.log(-torch.log(u + 1e-8) + 1e-8)).argmax(-1)
        W = mog.proj_mus.weight.view(cfg.mog.num_predictions, cfg.mog.low_rank, -1)
        mu = torch.stack([mog.low_mat[comp[b]] @ (W[comp[b]] @ x[b]) for b in range(B)])
        logs = mog.proj_logs(x).clamp_min(cfg.mog.min_log_std)
        z = mu * logs.exp() + mog.proj_else(x) + logs.exp() * normal[:, p] * cfg.noise_scale
        r = z if (restart or carry is None) else carry
        for i in range(cnt, cnt + k):
            dist = ((r[:, None, :] - model.rvq_embs[i][None]) ** 2).sum(-1)
            codes[:, i] = dist.argmin(-1)
            r = r - model.rvq_embs[i][codes[:, i]]
        carry = r
        cnt, p = cnt + k, p + 1
    return codes


@pytest.fixture(scope="module")
def gen_case():
    model = make_model()
    B, H = 4, model.cfg.backbone.hidden_size
    g = torch.Generator().manual_seed(4)
    h_c, h_u = torch.randn(B, H, generator=g), torch.randn(B, H, generator=g)
    return model, h_c, h_u, draws(B, model, 5)


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.triton_interpret)])
def test_generate_step_matches_spec_transcription(gen_case, kernels):
    """kernels: the GPU's path through the interpreter (the top-p + Gumbel-max draw as one kernel,
    ops/top_p_sample.py, and the talker's norm kernels); the codes must still equal the transcription's."""
    model, h_c, h_u, (uniform, normal) = gen_case
    assert model.num_passes == 5 and model.pass_sizes == [1, 1, 3, 4, 22]
    with torch.no_grad():
        ours = model.generate_step(torch.cat([h_c, h_u]), uniform, normal)
        ref = spec_generate_step(model, h_c, h_u, uniform, normal)
    assert ours.shape == (4, 31) and ours.dtype == torch.long
    assert ((ours >= 0) & (ours < model.cfg.codebook_size)).all()
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("variant", [dict(cfg_on="hidden"), dict(cfg_on="logits"), dict(restart=False)])
def test_generate_step_pitfall_variants_differ(gen_case, variant):
    """Pitfalls 9.7/9.8: CFG before the trunk or on logits, or a residual carried across passes, give
    other codes than ours on the same draws."""
    model, h_c, h_u, (uniform, normal) = gen_case
    with torch.no_grad():
        ours = model.generate_step(torch.cat([h_c, h_u]), uniform, normal)
        other = spec_generate_step(model, h_c, h_u, uniform, normal, **variant)
    assert not torch.equal(ours, other)


def test_generate_step_draw_dependence():
    """top_k=1 and noise 0: codes independent of the draws (12.8); release values: they depend on the
    draws and are reproducible for the same draws."""
    greedy = make_model(top_k=1, noise_scale=0.0)
    release = make_model()
    B, H = 4, greedy.cfg.backbone.hidden_size
    g = torch.Generator().manual_seed(6)
    h_c, h_u = torch.randn(B, H, generator=g), torch.randn(B, H, generator=g)
    with torch.no_grad():
        a = greedy.generate_step(torch.cat([h_c, h_u]), *draws(B, greedy, 1))
        b = greedy.generate_step(torch.cat([h_c, h_u]), *draws(B, greedy, 2))
        assert torch.equal(a, b)
        c = release.generate_step(torch.cat([h_c, h_u]), *draws(B, release, 1))
        d = release.generate_step(torch.cat([h_c, h_u]), *draws(B, release, 1))
        e = release.generate_step(torch.cat([h_c, h_u]), *draws(B, release, 2))
    assert torch.equal(c, d)
    assert not torch.equal(c, e)


def test_generate_step_counts_passes(gen_case):
    model, h_c, h_u, (uniform, normal) = gen_case
    calls = []
    handle = model.mog_head.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    try:
        with torch.no_grad():
            model.generate_step(torch.cat([h_c, h_u]), uniform, normal)
    finally:
        handle.remove()
    assert calls == [8] * 5  # 5 passes, cond and uncond batched


def test_residual_quantise_picks_nearest_codeword():
    g = torch.Generator().manual_seed(7)
    books = torch.randn(4, 64, 32, generator=g)
    z = torch.randn(16, 32, generator=g) * 2
    codes = residual_quantise(z, books)
    r = z.clone()
    for i in range(4):
        dist = ((r[:, None, :] - books[i][None]) ** 2).sum(-1)
        assert torch.equal(codes[:, i], dist.argmin(-1))
        r = r - books[i][codes[:, i]]


def test_logit_filters_match_transformers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(8, 16, generator=torch.Generator().manual_seed(8)) * 3
    for p in (0.3, 0.8, 0.95):
        assert torch.equal(top_p_filter(logits, p), TopPLogitsWarper(p)(None, logits.clone()))
    for k in (1, 3):
        assert torch.equal(top_k_filter(logits, k), TopKLogitsWarper(k)(None, logits.clone()))


# ------------------------------------------------------------------------------------------------
# warm-up + steps through the cache == full recompute; silence on EOS


def recompute_codes(model, latent, silence, ids, uniform, normal):
    """Reference loop for one call: rebuild the whole input sequence every step, run the full backbone."""
    with torch.no_grad():
        x_c, x_u = model.warmup_inputs(latent, silence)
        prev = torch.full((1, 31), model.cfg.codebook_size)
        out = []
        for t, tid in enumerate(ids):
            if tid == EOS:
                prev = silence[None]
            audio = model.embed_code(model.depthsum(prev))
            cond = model.text_condition(torch.tensor([tid]))
            x_c = torch.cat([x_c, model.fuse(audio, cond)])
            x_u = torch.cat([x_u, model.fuse(audio, model.null_emb[None])])
            n = x_c.shape[0]
            h = model.backbone(torch.stack([x_c, x_u]), torch.arange(n)[None].expand(2, -1))[:, -1]
            prev = model.generate_step(h, uniform[t:t + 1], normal[t:t + 1])
            out.append(prev[0])
    return torch.stack(out)


def test_steps_after_warmup_match_full_recompute():
    """Two calls (slots 1 and 0) and a sink padding row, 14 steps reaching positions past the sliding
    window (37 + 14 > 48). Codes must be identical to rebuilding the whole sequence every step."""
    model = make_model()
    H, T, S = model.cfg.backbone.hidden_size, 14, 3
    g = torch.Generator().manual_seed(9)
    latent = torch.randn(1, 37, H, generator=g)
    silence = torch.randint(0, 64, (31,), generator=g)
    ids = [[PAD, BOS, 150, 151, 200, EOS, PAD, PAD, BOS, 300, 301, EOS, PAD, PAD],
           [PAD, PAD, PAD, BOS, 120, 121, 122, 123, 124, 125, EOS, PAD, PAD, PAD]]
    rolls = [draws(T, model, 10 + c) for c in range(2)]
    cache = model.allocate_cache(S, 64, "cpu", torch.float32)
    slots = torch.tensor([1, 0, 2])  # calls 0 and 1 in slots 1 and 0, a padding row in the sink
    with torch.no_grad():
        model.prefill_warmup(cache, slots[:2], latent, silence)
        prev = torch.full((3, 31), model.cfg.codebook_size)
        got = []
        for t in range(T):
            text = torch.tensor([ids[0][t], ids[1][t], EOS])
            pad_u, pad_n = draws(1, model, 100 + t)
            uniform = torch.cat([rolls[0][0][t:t + 1], rolls[1][0][t:t + 1], pad_u])
            normal = torch.cat([rolls[0][1][t:t + 1], rolls[1][1][t:t + 1], pad_n])
            positions = torch.tensor([37 + t, 37 + t, 5])
            prev = model.step(text, prev, cache, slots, positions, uniform, normal, silence)
            got.append(prev[:2].clone())
    got = torch.stack(got, 1)  # [2 calls, T, Q]
    for c in range(2):
        ref = recompute_codes(model, latent, silence, ids[c], *rolls[c])
        assert torch.equal(got[c], ref), c


def test_silence_on_eos_only_for_eos():
    model = make_model()
    H = model.cfg.backbone.hidden_size
    g = torch.Generator().manual_seed(11)
    latent = torch.randn(1, 37, H, generator=g)
    silence = torch.randint(0, 64, (31,), generator=g)
    other = torch.randint(0, 64, (31,), generator=g)
    u, n = draws(1, model, 12)

    def two_slot_step(tid):
        cache = model.allocate_cache(3, 48, "cpu", torch.float32)
        slots = torch.tensor([0, 1])
        with torch.no_grad():
            model.prefill_warmup(cache, slots, latent, silence)
            prev = torch.stack([other, silence])
            return model.step(torch.tensor([tid, tid]), prev, cache, slots, torch.tensor([37, 37]),
                              u.expand(2, -1, -1), n.expand(2, -1, -1), silence)

    eos = two_slot_step(EOS)
    assert torch.equal(eos[0], eos[1])  # EOS: the previous codes were replaced by silence
    pad = two_slot_step(PAD)
    assert not torch.equal(pad[0], pad[1])  # PAD: previous codes kept


# ------------------------------------------------------------------------------------------------
# init_weights


def test_init_weights_deterministic_and_bounded():
    a, b, c = make_model(seed=0), make_model(seed=0), make_model(seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())
    # distinct codewords in every codebook
    for book in a.rvq_embs:
        assert torch.cdist(book, book).add(torch.eye(book.shape[0]) * 1e9).min() > 1e-3
    H = a.cfg.backbone.hidden_size
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        x = torch.randn(2, 40, H, generator=g)
        h = a.backbone(x, torch.arange(40)[None].expand(2, -1))
        t = a.text_condition(torch.arange(0, VOCAB, 7))
        m = a.mog_head.mlp_stack(h[:, -1])
    for y in (h, t, m):
        rms = y.pow(2).mean().sqrt()
        assert torch.isfinite(y).all() and 0.05 < rms < 20, rms


# ------------------------------------------------------------------------------------------------
# full size on the GPU


def full_size_vocab(n: int = 2048) -> list[str]:
    specials = ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, 16)]
    chars = [chr(0x21 + i) for i in range(256)]  # 256 single-character tokens (spec 4.2.2)
    g = torch.Generator().manual_seed(0)
    tokens = specials + chars
    while len(tokens) < n:
        idx = torch.randint(0, 256, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        tokens.append(["", "Ġ", "▁"][len(tokens) % 3] + "".join(chars[i] for i in idx))
    return tokens


@pytest.mark.gpu
def test_full_size_cached_step_and_talker_step_on_gpu():
    """Release dimensions on CUDA: cached backbone steps equal the full forward (fp32, TF32 off,
    atol 2e-3 / rtol 2e-3 on O(1) activations), and warm-up + EarTTS.step give valid codes in bf16."""
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    with dev:
        model = EarTTS(TalkerConfig(), 2048)
    model.set_vocab(full_size_vocab(), BOS, EOS, PAD)
    model.init_weights(torch.Generator().manual_seed(0))
    model.eval()
    H, T, S = 1152, 40, 3
    g = torch.Generator(device=dev).manual_seed(1)
    xs = torch.randn(2, T, H, generator=g, device=dev)
    with torch.no_grad():
        full = model.backbone(xs, torch.arange(T, device=dev)[None].expand(2, -1))
        cache = model.allocate_cache(S, 64, dev, torch.float32)
        rows = torch.tensor([1, S + 0, 2], device=dev)  # calls 0 and 1: stream 0 slot 1 and stream 1 slot 0; sink
        out = []
        for t in range(T):
            x = torch.stack([xs[0, t], xs[1, t], torch.randn(H, generator=g, device=dev)])
            out.append(model.backbone.step(x, torch.tensor([t, t, 7], device=dev), cache, rows)[:2])
    torch.testing.assert_close(torch.stack(out, 1), full, atol=2e-3, rtol=2e-3)

    model.to(torch.bfloat16)
    latent = torch.randn(1, 37, H, generator=g, device=dev)
    silence = torch.randint(0, 1024, (31,), device=dev)
    cache = model.allocate_cache(S, 128, dev, torch.bfloat16)
    slots = torch.tensor([0, 1], device=dev)
    with torch.no_grad():
        model.prefill_warmup(cache, slots, latent, silence)
        prev = torch.full((2, 31), 1024, device=dev)
        for t in range(20):
            uniform = torch.rand(2, model.num_passes, 1024, generator=g, device=dev)
            normal = torch.randn(2, model.num_passes, 512, generator=g, device=dev)
            text = torch.tensor([[PAD, 300][t % 2], EOS if t == 10 else 500], device=dev)
            prev = model.step(text, prev, cache, slots, torch.full((2,), 37 + t, device=dev), uniform, normal, silence)
            assert prev.shape == (2, 31) and ((prev >= 0) & (prev < 1024)).all()


@pytest.mark.gpu
def test_full_size_tables_on_gpu():
    """EarTTS.build_tables at release dimensions on CUDA, bf16 (a 2048-token vocabulary of up to 12
    characters): the text table against the char encoder run on the ids themselves (other batch shapes,
    so other cuBLAS kernels: stated tolerance atol 3e-2 / rtol 3e-2 on O(1) embeddings, a few bf16 steps),
    and 10 frames of talker codes with the code table, fp32 codebooks and norms built equal, bit for bit,
    to the codes without them (the same kernels on the same values)."""
    dev = torch.device("cuda")
    with dev:
        model = EarTTS(TalkerConfig(), 2048)
    model.set_vocab(full_size_vocab(), BOS, EOS, PAD)
    model.init_weights(torch.Generator().manual_seed(0))
    model = model.eval().to(torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(2)
    ids = torch.randint(0, 2048, (64,), generator=g, device=dev)
    h = [torch.randn(10, 4, 1152, generator=g, device=dev).to(torch.bfloat16) for _ in range(2)]
    draws_ = [(torch.rand(4, model.num_passes, 1024, generator=g, device=dev),
               torch.randn(4, model.num_passes, 512, generator=g, device=dev)) for _ in range(10)]
    with torch.no_grad():
        reference = model.embed_subword(ids)
        without = [model.generate_step(torch.cat([h[0][t], h[1][t]]), *draws_[t]) for t in range(10)]
        model.build_tables()
        assert model.text_table.shape == (2048, 1152) and model.text_table.dtype == torch.bfloat16
        torch.testing.assert_close(model.text_condition(ids), reference, atol=3e-2, rtol=3e-2)
        with_tables = [model.generate_step(torch.cat([h[0][t], h[1][t]]), *draws_[t]) for t in range(10)]
    for a, b in zip(without, with_tables):
        assert torch.equal(a, b)


def test_backbone_rope_frequencies_give_rotary_cos_sin_bit_for_bit():
    """The step's cos / sin for both thetas from one product with the backbone's frequency buffer equal
    rotary_cos_sin's for each theta, bit for bit; a cast leaves the buffer in fp32 (rebuilt, not rounded)."""
    from nemo_duplex.models.talker import rotary_cos_sin

    model = make_model()
    backbone = model.backbone
    assert len(backbone.rope_thetas) == 2 and "rope_freqs" not in model.state_dict()
    positions = torch.randint(0, 9000, (7,), generator=torch.Generator().manual_seed(3))
    angles = positions[:, None, None] * backbone.rope_freqs
    for i, theta in enumerate(backbone.rope_thetas):
        cos, sin = rotary_cos_sin(positions[:, None], backbone.layers[0].self_attn.head_dim, theta)
        assert torch.equal(angles[:, i:i + 1].cos(), cos) and torch.equal(angles[:, i:i + 1].sin(), sin)
    before = backbone.rope_freqs.clone()
    model.to(torch.bfloat16)
    assert backbone.rope_freqs.dtype == torch.float32 and torch.equal(backbone.rope_freqs, before)
