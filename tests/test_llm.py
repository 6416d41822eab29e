"""Nemotron-H (nemo_duplex/models/llm.py): checkpoint keys, transformers parity, Mamba-2 pitfalls (spec 9.11),
cached step/prefill over slot pools vs the full-sequence forward, init_weights."""
import math

import pytest
import torch
import torch.nn.functional as F

from nemo_duplex.models.config import LLMConfig, tiny_config
from nemo_duplex.models.llm import Mamba2Mixer, NemotronH, reset_slots
from tests.ops.support import DEVICE

torch.set_grad_enabled(False)
# kernel-path tests run on the GPU where there is one, else through TRITON_INTERPRET=1 (tests/conftest.py)


def tiny_model(seed=0):
    cfg = tiny_config().llm
    model = NemotronH(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return cfg, model


# ---------------------------------------------------------------------------------------- checkpoint keys

def spec_llm_keys() -> dict[str, tuple]:
    """Spec 6.3 table (prefix stt_model.llm.), with the layer kinds of spec 3.2, written out literally."""
    attention = {14, 21, 30, 39}
    mamba = {0, 2, 4, 6, 7, 9, 11, 13, 16, 18, 20, 23, 25, 27, 29, 32, 34, 36, 38, 41, 43, 44, 46, 48, 50, 52, 54}
    keys = {"norm_f.weight": (4480,)}
    for i in range(56):
        p = f"layers.{i}."
        keys[p + "norm.weight"] = (4480,)
        if i in mamba:
            keys.update({p + "mixer.in_proj.weight": (22656, 4480), p + "mixer.conv1d.weight": (12288, 1, 4),
                         p + "mixer.conv1d.bias": (12288,), p + "mixer.A_log": (128,), p + "mixer.D": (128,),
                         p + "mixer.dt_bias": (128,), p + "mixer.norm.weight": (10240,),
                         p + "mixer.out_proj.weight": (4480, 10240)})
        elif i in attention:
            keys.update({p + "mixer.q_proj.weight": (5120, 4480), p + "mixer.k_proj.weight": (1024, 4480),
                         p + "mixer.v_proj.weight": (1024, 4480), p + "mixer.o_proj.weight": (4480, 5120)})
        else:
            keys.update({p + "mixer.up_proj.weight": (15680, 4480), p + "mixer.down_proj.weight": (4480, 15680)})
    return keys


def test_state_dict_matches_spec_at_full_size():
    with torch.device("meta"):
        model = NemotronH(LLMConfig())
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    spec = spec_llm_keys()
    assert sorted(set(ours) - set(spec)) == [] and sorted(set(spec) - set(ours)) == []
    assert ours == spec
    assert len(LLMConfig().layer_indices("M")) == 27 and len(LLMConfig().layer_indices("-")) == 25


# ---------------------------------------------------------------------------------------- transformers parity

def transformers_model(cfg: LLMConfig, ours: NemotronH, chunk_size: int):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.NemotronHConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, hybrid_override_pattern=cfg.hybrid_override_pattern,
        intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, mamba_num_heads=cfg.mamba_num_heads,
        mamba_head_dim=cfg.mamba_head_dim, ssm_state_size=cfg.ssm_state_size, n_groups=cfg.n_groups,
        conv_kernel=cfg.conv_kernel, layer_norm_epsilon=cfg.layer_norm_epsilon, mlp_hidden_act="relu2",
        use_conv_bias=True, mamba_proj_bias=False, use_bias=False, attention_bias=False, mlp_bias=False,
        chunk_size=chunk_size, attn_implementation="eager")
    hf = transformers.NemotronHModel(hf_cfg).eval()
    state = dict(ours.state_dict())
    state["embeddings.weight"] = torch.zeros(cfg.vocab_size, cfg.hidden_size)  # unused: we feed inputs_embeds
    hf.load_state_dict(state, strict=True)  # same key names below the prefix (spec 6.3)
    return hf


def record_dt(model: NemotronH):
    """Hooks on every in_proj that collect dt = softplus(dt_raw + dt_bias) of the Mamba layers."""
    seen = []
    for layer in model.layers:
        if layer.kind == "M":
            mixer = layer.mixer
            mixer.in_proj.register_forward_hook(
                lambda mod, inp, out, mixer=mixer: seen.append(
                    F.softplus(out[..., -mixer.num_heads:].float() + mixer.dt_bias.float())))
    return seen


def test_forward_matches_transformers():
    """Same weights, fp32, tiny config with 2 groups of 4 Mamba heads and GQA 4/2. transformers' CPU path
    (mamba2_chunk_scan) expands B/C with repeat_interleave, i.e. head h -> group h // 4 like ours and the
    mamba_ssm kernel, so no permutation is needed. transformers clamps dt at time_step_min = 1e-3 in this
    path (spec 12.6): the dt rows of in_proj are scaled down so dt stays in ~[6e-3, 0.15], checked below."""
    cfg, model = tiny_model(seed=1)
    for layer in model.layers:
        if layer.kind == "M":
            layer.mixer.in_proj.weight[-cfg.mamba_num_heads:] *= 0.1
    hf = transformers_model(cfg, model, chunk_size=8)  # T = 21 spans several SSD chunks
    dts = record_dt(model)
    x = torch.randn(3, 21, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    ours = model(x)
    ref = hf(inputs_embeds=x, use_cache=False).last_hidden_state
    assert min(float(d.min()) for d in dts) > 2e-3, "test weights must keep dt above transformers' clamp"
    # fp32 both; chunked SSD scan vs our sequential scan: 1e-5 relative (observed ~3e-7)
    assert (ours - ref).norm() / ref.norm() < 1e-5
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------- Mamba-2 pitfalls

def mixer_per_head_loop(mixer: Mamba2Mixer, x: torch.Tensor, tile_groups=False, clamp_dt=None, whole_norm=False):
    """An independent float64 Mamba-2 mixer for one sequence x [T, H], written head by head from spec 3.3.
    The flags produce the known wrong variants (spec 9 pitfall 11)."""
    x = x.double()
    H, P, N, G = mixer.num_heads, mixer.head_dim, mixer.d_state, mixer.n_groups
    d_inner, K = H * P, mixer.kernel
    proj = x @ mixer.in_proj.weight.double().T
    z, xbc, dt_raw = proj[:, :d_inner], proj[:, d_inner:d_inner + mixer.conv_dim], proj[:, -H:]
    T = x.shape[0]
    padded = torch.cat([torch.zeros(K - 1, mixer.conv_dim, dtype=torch.float64), xbc])
    w = mixer.conv1d.weight.double()[:, 0]  # [C, K]
    conv = torch.stack([(padded[t:t + K].T * w).sum(1) for t in range(T)]) + mixer.conv1d.bias.double()
    act = conv * torch.sigmoid(conv)
    xs, Bs, Cs = act[:, :d_inner], act[:, d_inner:d_inner + G * N], act[:, d_inner + G * N:]
    y = torch.zeros(T, d_inner, dtype=torch.float64)
    for h in range(H):
        g = h % G if tile_groups else h // (H // G)
        A = -math.exp(float(mixer.A_log[h]))
        S = torch.zeros(P, N, dtype=torch.float64)
        for t in range(T):
            dt = F.softplus(dt_raw[t, h] + float(mixer.dt_bias[h]))
            if clamp_dt is not None:
                dt = dt.clamp(min=clamp_dt)
            xh = xs[t, h * P:(h + 1) * P]
            S = math.exp(float(dt) * A) * S + dt * torch.outer(xh, Bs[t, g * N:(g + 1) * N])
            y[t, h * P:(h + 1) * P] = S @ Cs[t, g * N:(g + 1) * N] + float(mixer.D[h]) * xh
    gated = y * F.silu(z)
    group = d_inner if whole_norm else d_inner // G
    parts = gated.unflatten(-1, (-1, group))
    normed = (parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + 1e-5)).flatten(-2)
    return (normed * mixer.norm.weight.double()) @ mixer.out_proj.weight.double().T


def test_mamba_mixer_matches_per_head_loop_and_rejects_pitfalls():
    cfg, model = tiny_model(seed=2)
    mixer = model.layers[0].mixer
    assert mixer.n_groups == 2 and mixer.num_heads == 8  # heads/group = 4: h // 4 and h % 2 disagree
    # heads 4..7 (group 1) get dt ~ 1e-4, well under transformers' 1e-3 clamp, and D = 0 so their SSM
    # part is what the output shows
    mixer.dt_bias[4:] = math.log(math.expm1(1e-4))
    mixer.in_proj.weight[-cfg.mamba_num_heads:] *= 0.01
    mixer.D[4:] = 0.0
    x = torch.randn(1, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    ours = mixer(x)[0][0].double()
    right = mixer_per_head_loop(mixer, x[0])
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(ours, right) < 1e-5  # fp32 vs float64
    assert rel(ours, mixer_per_head_loop(mixer, x[0], tile_groups=True)) > 1e-2
    assert rel(ours, mixer_per_head_loop(mixer, x[0], clamp_dt=1e-3)) > 1e-2
    assert rel(ours, mixer_per_head_loop(mixer, x[0], whole_norm=True)) > 1e-2


def test_step_kernel_path_rejects_pitfalls_too():
    """The Triton step must agree with the per-head loop as well (same flags as above)."""
    cfg, model = tiny_model(seed=4)
    mixer = model.layers[0].mixer
    mixer.dt_bias[4:] = math.log(math.expm1(1e-4))
    mixer.in_proj.weight[-cfg.mamba_num_heads:] *= 0.01
    mixer.D[4:] = 0.0
    x = torch.randn(1, 6, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    conv_pool = torch.zeros(2, mixer.conv_dim, mixer.kernel - 1)
    ssm_pool = torch.zeros(2, mixer.num_heads, mixer.head_dim, mixer.d_state)
    slots = torch.tensor([0])
    outs = torch.cat([mixer.step(x[:, t], conv_pool, ssm_pool, slots, use_kernels=True) for t in range(6)])
    right = mixer_per_head_loop(mixer, x[0])
    assert float((outs.double() - right).norm() / right.norm()) < 1e-5


# ---------------------------------------------------------------------------------------- cached execution

@pytest.mark.parametrize("use_kernels", [False, True])
def test_step_matches_forward_with_staggered_rows_and_sink(use_kernels):
    """Three calls at different positions in shuffled slots plus a padding row on the sink; slot 3 holds
    another call that must stay bit-identical. Every step output equals the full forward at that position."""
    cfg, model = tiny_model(seed=3)
    gen = torch.Generator().manual_seed(9)
    num_slots, max_len, n_steps = 5, 24, 5
    sink = num_slots - 1
    starts = [0, 3, 6]               # tokens each call already has before the batched steps
    slots = torch.tensor([2, 0, 1])  # their slots
    seqs = [torch.randn(s + n_steps, cfg.hidden_size, generator=gen) for s in starts]
    full = [model(seq[None])[0] for seq in seqs]

    cache = model.allocate_cache(num_slots, max_len, "cpu", torch.float32)
    other = torch.randn(1, 5, cfg.hidden_size, generator=gen)
    model.prefill(other, cache, torch.tensor([3]), torch.tensor([0]))  # the bystander call in slot 3
    for r, s in enumerate(starts):
        if s:
            h = model.prefill(seqs[r][None, :s], cache, slots[r:r + 1], torch.tensor([0]))
            torch.testing.assert_close(h[0], full[r][:s], rtol=1e-4, atol=1e-5)
    bystander = [t[:, 3].clone() for t in (cache.conv, cache.ssm, cache.k, cache.v)]

    batch_slots = torch.cat([slots, torch.tensor([sink])])
    lengths = torch.tensor(starts + [0])
    for t in range(n_steps):
        x = torch.stack([seqs[r][starts[r] + t] for r in range(3)] + [torch.randn(cfg.hidden_size, generator=gen)])
        h = model.step(x, cache, batch_slots, lengths, use_kernels=use_kernels)
        for r in range(3):
            # fp32; recurrent step vs sequential scan and SDPA vs gathered attention: 1e-4 rel / 1e-5 abs
            torch.testing.assert_close(h[r], full[r][starts[r] + t], rtol=1e-4, atol=1e-5)
        lengths = lengths + torch.tensor([1, 1, 1, 0])  # the padding row stays at position 0
    for before, pool in zip(bystander, (cache.conv, cache.ssm, cache.k, cache.v)):
        assert torch.equal(pool[:, 3], before)


@pytest.mark.parametrize("interpret", [False, pytest.param(True, marks=pytest.mark.triton_interpret)])
def test_kernel_and_reference_step_agree_on_the_same_pools(interpret, monkeypatch):
    """The kernel step (use_kernels; with `interpret` every Triton op of it, norms and the fused residual
    add + next norm included, runs through the interpreter on the CPU) against the torch step with the
    references (TRITON_INTERPRET unset for it), fp32, rtol 1e-4 / atol 1e-5, outputs and pools."""
    cfg, model = tiny_model(seed=5)
    model.to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    caches = [model.allocate_cache(4, 16, DEVICE, torch.float32) for _ in range(2)]
    slots, lengths = torch.tensor([1, 0, 3], device=DEVICE), torch.tensor([0, 0, 0], device=DEVICE)
    for t in range(3):
        x = torch.randn(3, cfg.hidden_size, generator=gen).to(DEVICE)
        with monkeypatch.context() as m:
            m.delenv("TRITON_INTERPRET", raising=False)
            h_ref = model.step(x, caches[0], slots, lengths + t, use_kernels=False)
        h_fast = model.step(x, caches[1], slots, lengths + t, use_kernels=True)
        torch.testing.assert_close(h_fast, h_ref, rtol=1e-4, atol=1e-5)
    for a, b in zip((caches[0].conv, caches[0].ssm, caches[0].k, caches[0].v),
                    (caches[1].conv, caches[1].ssm, caches[1].k, caches[1].v)):
        torch.testing.assert_close(b[:, :3], a[:, :3], rtol=1e-4, atol=1e-5)  # slot 3 is the sink


def test_prefill_in_chunks_with_rows_at_different_lengths():
    cfg, model = tiny_model(seed=6)
    gen = torch.Generator().manual_seed(2)
    seqs = torch.randn(2, 11, cfg.hidden_size, generator=gen)
    full = model(seqs)
    cache = model.allocate_cache(3, 16, "cpu", torch.float32)
    slots = torch.tensor([1, 0])
    h0 = model.prefill(seqs[:1, :3], cache, slots[:1], torch.tensor([0]))  # row 0 alone first: 3 tokens
    # then both rows together, 4 tokens each, row 0 from position 3 and row 1 from position 0
    both = torch.stack([seqs[0, 3:7], seqs[1, 0:4]])
    h1 = model.prefill(both, cache, slots, torch.tensor([3, 0]))
    torch.testing.assert_close(h0[0], full[0, :3], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(h1[0], full[0, 3:7], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(h1[1], full[1, 0:4], rtol=1e-4, atol=1e-5)
    h2 = model.step(torch.stack([seqs[0, 7], seqs[1, 4]]), cache, slots, torch.tensor([7, 4]))
    torch.testing.assert_close(h2, torch.stack([full[0, 7], full[1, 4]]), rtol=1e-4, atol=1e-5)


def test_reset_slots_starts_a_fresh_call():
    cfg, model = tiny_model(seed=7)
    gen = torch.Generator().manual_seed(4)
    cache = model.allocate_cache(3, 16, "cpu", torch.float32)
    model.prefill(torch.randn(2, 9, cfg.hidden_size, generator=gen), cache, torch.tensor([0, 1]), torch.tensor([0, 0]))
    keep = (cache.conv[:, 1].clone(), cache.ssm[:, 1].clone())
    reset_slots(cache, torch.tensor([0]))
    assert cache.conv[:, 0].abs().max() == 0 and cache.ssm[:, 0].abs().max() == 0
    assert torch.equal(cache.conv[:, 1], keep[0]) and torch.equal(cache.ssm[:, 1], keep[1])
    # the new call in slot 0 sees nothing of the old one (its stale k/v past length 0 are masked)
    seq = torch.randn(1, 4, cfg.hidden_size, generator=gen)
    full = model(seq)[0]
    for use_kernels in (False, True):
        c = model.allocate_cache(3, 16, "cpu", torch.float32)
        for mine, old in zip((c.conv, c.ssm, c.k, c.v), (cache.conv, cache.ssm, cache.k, cache.v)):
            mine.copy_(old)
        c.v[:, 0, :, 2:] = float("nan")  # junk past the new call's length must not leak in
        for t in range(4):
            h = model.step(seq[:, t], c, torch.tensor([0]), torch.tensor([t]), use_kernels=use_kernels)
            torch.testing.assert_close(h[0], full[t], rtol=1e-4, atol=1e-5)


def test_bf16_step_with_fp32_ssm_state_tracks_fp32():
    cfg, model = tiny_model(seed=8)
    gen = torch.Generator().manual_seed(5)
    seq = torch.randn(2, 4, cfg.hidden_size, generator=gen)
    full = model(seq)
    model_bf16 = NemotronH(cfg).to(torch.bfloat16)
    model_bf16.load_state_dict(model.state_dict())
    for use_kernels in (False, True):
        cache = model_bf16.allocate_cache(3, 8, "cpu", torch.bfloat16, ssm_dtype=torch.float32)
        assert cache.ssm.dtype == torch.float32 and cache.k.dtype == torch.bfloat16
        for t in range(4):
            h = model_bf16.step(seq[:, t].bfloat16(), cache, torch.tensor([0, 1]), torch.tensor([t, t]),
                                use_kernels=use_kernels)
            # bf16 weights and activations: ~3 significant digits, 5e-2 relative of the norm
            err = float((h.float() - full[:, t]).norm() / full[:, t].norm())
            assert err < 5e-2, (use_kernels, t, err)


# ---------------------------------------------------------------------------------------- init_weights

def test_init_weights_deterministic_and_o1():
    cfg, a = tiny_model(seed=11)
    _, b = tiny_model(seed=11)
    _, c = tiny_model(seed=12)
    for (name, p), q, r in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(p, q), name
        assert not torch.equal(p, r), name
    for layer in a.layers:
        if layer.kind == "M":
            dt = F.softplus(layer.mixer.dt_bias)
            assert dt.min() >= 1e-2 * 0.999 and dt.max() <= 1e-1 * 1.001
            A = -torch.exp(layer.mixer.A_log)
            assert A.min() >= -16 and A.max() <= -1
    x = torch.randn(2, 32, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    h = a(x)
    assert torch.isfinite(h).all() and 0.3 < float(h.std()) < 3.0
    # the residual stream before norm_f stays O(1) too
    stream = x
    for layer in a.layers:
        out = layer.mixer(layer.norm(stream))
        stream = stream + (out[0] if layer.kind == "M" else out)
    assert 0.3 < float(stream.std()) < 5.0


@pytest.mark.parametrize("T,chunk", [(1, 64), (30, 7), (64, 64), (130, 64)])
def test_chunked_ssm_scan_equals_the_recurrence(T, chunk):
    """The SSD form (prefill) against the position-by-position recurrence, fp32, fresh random inputs with a
    nonzero starting state, chunks that do and do not divide T: within rtol 1e-4, atol 1e-5 (float rounding of
    the two summation orders; decays down to exp(-20) within a chunk)."""
    from nemo_duplex.models.llm import ssm_scan, ssm_scan_chunked

    g = torch.Generator().manual_seed(T)
    b, h, p, n = 2, 4, 8, 16
    x = torch.randn(b, T, h, p, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(b, T, h, generator=g))
    A = -torch.exp(torch.randn(h, generator=g))
    B, C = torch.randn(b, T, h, n, generator=g), torch.randn(b, T, h, n, generator=g)
    D, state = torch.randn(h, generator=g), torch.randn(b, h, p, n, generator=g)
    y_ref, s_ref = ssm_scan(x, dt, A, B, C, D, state)
    y, s = ssm_scan_chunked(x, dt, A, B, C, D, state, chunk=chunk)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-5)
