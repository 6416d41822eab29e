"""FastConformer + Perception: checkpoint keys at full size, the offline mask and rel_shift, frame
counts, causality, and the key property: the batched cache-aware streaming step equals the offline
encoder on every frame (spec 2.8, 12.2), for both front-end variants."""
import random

import pytest
import torch

from nemo_duplex.models.config import EncoderConfig, FrontendConfig, tiny_config
from nemo_duplex.models.encoder import Perception, chunked_limited_mask, rel_shift

FRAME = 1280
REL_TOL = 1e-5  # streaming vs offline, fp32: max |diff| / max |offline| per call


def expected_perception_keys() -> dict[str, tuple]:
    """Spec 6.3, prefix stt_model.perception. stripped."""
    keys = {"preprocessor.featurizer.fb": (1, 128, 257), "preprocessor.featurizer.window": (400,),
            "encoder.pre_encode.conv.0.weight": (256, 1, 3, 3), "encoder.pre_encode.conv.0.bias": (256,),
            "encoder.pre_encode.out.weight": (1024, 4352), "encoder.pre_encode.out.bias": (1024,),
            "proj.weight": (4480, 1024), "proj.bias": (4480,)}
    for i in (2, 5):
        keys[f"encoder.pre_encode.conv.{i}.weight"] = (256, 1, 3, 3)
        keys[f"encoder.pre_encode.conv.{i + 1}.weight"] = (256, 256, 1, 1)
        keys[f"encoder.pre_encode.conv.{i}.bias"] = keys[f"encoder.pre_encode.conv.{i + 1}.bias"] = (256,)
    for layer in range(24):
        p = f"encoder.layers.{layer}."
        for norm in ("norm_feed_forward1", "norm_self_att", "norm_conv", "norm_feed_forward2", "norm_out",
                     "conv.batch_norm"):
            keys[p + norm + ".weight"] = keys[p + norm + ".bias"] = (1024,)
        for ff in ("feed_forward1", "feed_forward2"):
            keys[p + ff + ".linear1.weight"] = (4096, 1024)
            keys[p + ff + ".linear2.weight"] = (1024, 4096)
        for lin in ("q", "k", "v", "out", "pos"):
            keys[p + f"self_attn.linear_{lin}.weight"] = (1024, 1024)
        keys[p + "self_attn.pos_bias_u"] = keys[p + "self_attn.pos_bias_v"] = (8, 128)
        keys[p + "conv.pointwise_conv1.weight"] = (2048, 1024, 1)
        keys[p + "conv.depthwise_conv.weight"] = (1024, 1, 9)
        keys[p + "conv.pointwise_conv2.weight"] = (1024, 1024, 1)
    return keys


def test_state_dict_keys_and_shapes_full_size():
    with torch.device("meta"):
        model = Perception(FrontendConfig(), EncoderConfig())
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    want = expected_perception_keys()
    assert sorted(set(got) ^ set(want)) == []
    assert got == want


def test_chunked_limited_mask_rule():
    lengths = torch.tensor([90, 40, 1])
    mask = chunked_limited_mask(lengths, 90, left=70, right=0)
    for b, n in enumerate(lengths.tolist()):
        want = torch.tensor([[0 <= i - j <= 70 and i < n and j < n for j in range(90)] for i in range(90)])
        assert torch.equal(mask[b], want)


def test_rel_shift_gives_distance_i_minus_j():
    t = 7
    x = torch.randn(2, 3, t, 2 * t - 1)  # column c <-> position t-1-c
    shifted = rel_shift(x)[..., :t]
    for i in range(t):
        for j in range(i + 1):  # the entries attention uses (j <= i)
            assert torch.equal(shifted[..., i, j], x[..., i, (t - 1) - (i - j)])


def make_perception(variant="release", seed=0) -> Perception:
    cfg = tiny_config()
    model = Perception(FrontendConfig(variant=variant), cfg.encoder)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.eval()


def random_audio(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(1, generator=g).item() * 0.5 + 0.05
    return scale * torch.randn(n, generator=g)


@torch.no_grad()
@pytest.mark.parametrize("variant", ["release", "nemo3"])
def test_offline_frame_counts(variant):
    model = make_perception(variant)
    for n, want in [(12800, 11), (12960, 12), (FRAME * 3, 4), (FRAME * 3 + 100, 4)]:
        if variant == "nemo3":  # N//160 mel columns instead of N//160 + 1
            cols = n // 160
            for _ in range(3):
                cols = cols // 2 + 1
            want = cols
        enc, enc_len = model(random_audio(n, 0)[None], torch.tensor([n]))
        # The time axis covers every STFT column; nemo3's last one is padding (enc_len says so).
        assert enc_len.tolist() == [want] and enc.shape[1] in (want, want + 1) and enc.shape[2] == 64
    # K chunks: offline K+1 frames in both variants (8K or 8K+1 mel columns), streaming K (spec 2.8).
    assert model(random_audio(10 * FRAME, 1)[None], torch.tensor([10 * FRAME]))[1].item() == 11


@torch.no_grad()
def test_offline_is_causal(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = make_perception()
    n, s = 30 * FRAME + 500, 17 * FRAME + 40
    audio = random_audio(n, 2)[None]
    changed = audio.clone()
    changed[:, s:] = random_audio(n - s, 3)
    enc_a, _ = model(audio, torch.tensor([n]))
    enc_b, _ = model(changed, torch.tensor([n]))
    # Frame k reads samples up to 1280k + 255 (its last mel column 8k ends there, spec 2.7).
    untouched = [k for k in range(enc_a.shape[1]) if FRAME * k + 255 < s]
    assert untouched == list(range(17))
    scale = enc_a.abs().max()
    assert ((enc_a[0, untouched] - enc_b[0, untouched]).abs().max() / scale) < 1e-6
    assert ((enc_a[0, 17] - enc_b[0, 17]).abs().max() / scale) > 1e-3  # the next frame does see it


@torch.no_grad()
def test_offline_batch_rows_match_single(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = make_perception()
    lengths = [20 * FRAME, 9 * FRAME + 700]
    audio = torch.zeros(2, lengths[0])
    for i, n in enumerate(lengths):
        audio[i, :n] = random_audio(n, 10 + i)
    enc, enc_len = model(audio, torch.tensor(lengths))
    for i, n in enumerate(lengths):
        alone, alone_len = model(audio[i:i + 1, :n], torch.tensor([n]))
        assert enc_len[i] == alone_len[0]
        inside = (n - 256) // FRAME  # frames whose mel columns never reach past the row's end
        torch.testing.assert_close(enc[i, :inside], alone[0, :inside], atol=1e-4, rtol=1e-5)


def run_streaming(model, clips, starts, slots, num_slots, seed=0):
    """Stream calls (clips [N_i] samples, start step, slot) through stream_step, several calls per batch
    at different frame indices, in shuffled row order, plus two padding rows on the sink slot.
    Returns the frames per call [K_i, d] and the final state."""
    sink = num_slots - 1
    state = model.allocate_stream_state(num_slots, "cpu", torch.float32)
    state.keys.normal_()  # stale garbage from earlier calls: reset_slots + masking must hide it
    state.values.normal_()
    state.audio_tail.normal_()
    state.mel_tail.normal_()
    model.reset_slots(state, torch.tensor(slots))
    rng = random.Random(seed)
    chunks = [clip.shape[0] // FRAME for clip in clips]
    frames = [[] for _ in clips]
    for step in range(max(s + k for s, k in zip(starts, chunks))):
        rows = [i for i in range(len(clips)) if starts[i] <= step < starts[i] + chunks[i]]
        rng.shuffle(rows)
        audio = [clips[i][(step - starts[i]) * FRAME:(step - starts[i] + 1) * FRAME] for i in rows]
        audio += [torch.randn(FRAME), torch.randn(FRAME)]  # padding rows carry junk
        batch_slots = torch.tensor([slots[i] for i in rows] + [sink, sink])
        enc = model.stream_step(torch.stack(audio), state, batch_slots)
        for row, i in enumerate(rows):
            frames[i].append(enc[row])
    return [torch.stack(f) for f in frames], state


def assert_stream_equals_offline(model, clips, streamed):
    for clip, got in zip(clips, streamed):
        n = clip.shape[0]
        offline, offline_len = model(clip[None], torch.tensor([n]))
        k = n // FRAME
        assert got.shape[0] == k and offline_len.item() >= k
        want = offline[0, :k]
        rel = (got - want).abs().max() / want.abs().max()
        assert rel <= REL_TOL, f"streaming differs from offline: max rel {rel:.2e}"


@torch.no_grad()
def test_streaming_equals_offline_batched_release(monkeypatch):
    # Torch reference path for the ops (the Triton interpreter is too slow for ~100 steps; the kernels
    # have their own tests and test_streaming_through_triton_interpreter covers the wiring).
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = make_perception("release")
    lengths = [90 * FRAME + 700, 40 * FRAME, 12 * FRAME + 300, 75 * FRAME]  # shorter and longer than 70
    clips = [random_audio(n, 20 + i) for i, n in enumerate(lengths)]
    clips[2][: 3 * FRAME] = 0.0  # a call that starts with digital silence
    slots = [3, 0, 5, 1]  # slots 2 and 4 stay idle; 6 is the sink
    streamed, state = run_streaming(model, clips, starts=[0, 7, 30, 2], slots=slots, num_slots=7)
    assert_stream_equals_offline(model, clips, streamed)
    assert state.frames_done[slots].tolist() == [n // FRAME for n in lengths]
    for idle in (2, 4):  # untouched by any call or the padding rows
        assert state.frames_done[idle] == 0 and state.keys[:, idle].abs().sum() > 0  # still the junk


@torch.no_grad()
def test_streaming_equals_offline_nemo3(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = make_perception("nemo3", seed=1)
    clips = [random_audio(14 * FRAME + 999, 30), random_audio(9 * FRAME, 31)]
    streamed, _ = run_streaming(model, clips, starts=[0, 3], slots=[1, 0], num_slots=3)
    assert_stream_equals_offline(model, clips, streamed)


@torch.no_grad()
@pytest.mark.triton_interpret
def test_streaming_through_triton_interpreter():
    # The real kernels (Triton interpreter on CPU when there is no GPU), few frames: wiring check.
    model = make_perception("release", seed=2)
    clips = [random_audio(4 * FRAME, 40), random_audio(3 * FRAME + 10, 41)]
    streamed, _ = run_streaming(model, clips, starts=[0, 1], slots=[0, 1], num_slots=3)
    assert_stream_equals_offline(model, clips, streamed)


@torch.no_grad()
def test_offline_has_one_more_frame_than_streaming(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = make_perception()
    k = 6
    clip = random_audio(k * FRAME, 50)
    offline, offline_len = model(clip[None], torch.tensor([k * FRAME]))
    streamed, state = run_streaming(model, [clip], starts=[0], slots=[0], num_slots=2)
    assert offline_len.item() == k + 1 and streamed[0].shape[0] == k and state.frames_done[0] == k


@torch.no_grad()
def test_pos_tables_follow_loaded_weights(monkeypatch):
    # P[d] is derived from linear_pos: loading new weights must not leave a stale table behind.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = make_perception(seed=3)
    other = make_perception(seed=4)
    clip = random_audio(5 * FRAME, 60)
    run_streaming(model, [clip], starts=[0], slots=[0], num_slots=2)  # builds the tables from seed 3
    model.load_state_dict(other.state_dict())
    streamed, _ = run_streaming(model, [clip], starts=[0], slots=[0], num_slots=2)
    assert_stream_equals_offline(other, [clip], streamed)
    assert "encoder.layers.0.self_attn.pos_by_distance" not in model.state_dict()


def test_allocating_the_stream_state_builds_the_streaming_tables():
    """The tables stream_step reads (P[d], the stacked q/k/v) exist once a state is allocated, before any
    step: a torch.compile build of the first step otherwise traced their lazy build, a graph break that
    failed it (scripts/dev/profile_step.py with engine.graph_backend=reduce-overhead)."""
    model = make_perception(seed=3)
    assert not model.stream_tables_ready() and model.encoder.layers[0].self_attn.stack is None
    model.allocate_stream_state(2, "cpu", torch.float32)
    assert model.stream_tables_ready()
    assert all(layer.self_attn.stack is not None for layer in model.encoder.layers)


@torch.no_grad()
def test_streaming_qkv_stack_is_the_weights_themselves():
    """The streaming step's one q/k/v GEMM reads `stack` (nemo_duplex/models/stacking.py), whose row blocks ARE
    linear_q/k/v's weights: no second copy (a concatenated copy would be 144 MiB at full size in
    bf16), a state_dict load writes into it, a cast re-stacks it; the checkpoint keys are unchanged."""
    model = make_perception(seed=5)
    keys = set(model.state_dict())
    model.prepare_stream()
    attns = [layer.self_attn for layer in model.encoder.layers]

    def views_of_stack(attn):
        blocks = torch.cat([attn.linear_q.weight, attn.linear_k.weight, attn.linear_v.weight])
        return (torch.equal(attn.stack, blocks)
                and all(getattr(attn, name).weight.untyped_storage().data_ptr() == attn.stack.untyped_storage().data_ptr()
                        for name in attn.stacked))

    assert all(views_of_stack(a) for a in attns)
    tensors = [*model.parameters(), *model.buffers()]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == len(tensors) - 2 * len(attns)   # q, k, v: one storage per layer
    assert set(model.state_dict()) == keys
    other = make_perception(seed=6)
    stack = attns[0].stack
    model.load_state_dict(other.state_dict())
    assert attns[0].stack is stack and all(views_of_stack(a) for a in attns)   # written in place
    assert torch.equal(stack[: stack.shape[1]], other.encoder.layers[0].self_attn.linear_q.weight)
    model.double()
    assert all(views_of_stack(a) and a.stack.dtype == torch.float64 for a in attns)


@pytest.mark.gpu
@torch.no_grad()
def test_streaming_equals_offline_full_size_gpu():
    # Full-size encoder on CUDA, fp32 without TF32 (spec 1.6), Triton kernels for attention and the DFT.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = Perception(FrontendConfig(), EncoderConfig())
    model.init_weights(torch.Generator().manual_seed(0))
    model = model.cuda().eval()
    lengths = [80 * FRAME + 321, 20 * FRAME, 75 * FRAME]
    clips = [random_audio(n, 70 + i).cuda() for i, n in enumerate(lengths)]
    sink = 4
    state = model.allocate_stream_state(sink + 1, "cuda", torch.float32)
    model.reset_slots(state, torch.tensor([2, 0, 3], device="cuda"))
    starts, slots = [0, 5, 9], [2, 0, 3]
    frames = [[] for _ in clips]
    for step in range(max(s + n // FRAME for s, n in zip(starts, lengths))):
        rows = [i for i in range(3) if starts[i] <= step < starts[i] + lengths[i] // FRAME]
        audio = [clips[i][(step - starts[i]) * FRAME:(step - starts[i] + 1) * FRAME] for i in rows]
        audio.append(torch.randn(FRAME, device="cuda"))
        enc = model.stream_step(torch.stack(audio), state,
                                torch.tensor([slots[i] for i in rows] + [sink], device="cuda"))
        for row, i in enumerate(rows):
            frames[i].append(enc[row])
    for clip, got in zip(clips, frames):
        offline, _ = model(clip[None], torch.tensor([clip.shape[0]], device="cuda"))
        got = torch.stack(got)
        want = offline[0, :got.shape[0]]
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel <= 1e-4, f"max rel {rel:.2e}"  # 24 layers of fp32 GEMMs in different shapes


@pytest.mark.gpu
@torch.no_grad()
def test_stream_step_replays_in_a_cuda_graph():
    # The step is capturable: no host syncs, per-row positions on the device, state updated in place.
    model = Perception(FrontendConfig(), EncoderConfig())
    model.init_weights(torch.Generator().manual_seed(1))
    model = model.cuda().to(torch.bfloat16).eval()
    model.preprocessor.float()
    num_slots, batch = 9, 4
    eager_state = model.allocate_stream_state(num_slots, "cuda", torch.bfloat16)
    graph_state = model.allocate_stream_state(num_slots, "cuda", torch.bfloat16)
    slots = torch.tensor([5, 1, 7, 8], device="cuda")  # 8 = sink (padding row)
    audio = torch.zeros(batch, FRAME, device="cuda")
    model.prepare_stream()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compiles, DFT basis) outside the capture
        model.stream_step(audio, model.allocate_stream_state(num_slots, "cuda", torch.bfloat16), slots)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model.stream_step(audio, graph_state, slots)
    g = torch.Generator().manual_seed(2)
    for _ in range(75):
        audio.copy_(0.1 * torch.randn(batch, FRAME, generator=g))
        graph.replay()
        want = model.stream_step(audio, eager_state, slots)
        torch.testing.assert_close(out[:3].float(), want[:3].float(), atol=0, rtol=0)
    assert torch.equal(graph_state.frames_done, eager_state.frames_done)
    assert graph_state.frames_done[5].item() == 75
