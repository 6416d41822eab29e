"""The assembled model: channel fusion, the offline reference loop and the streaming loop (spec 1.3,
7.1, 7.2), and the spec's section-9 pitfalls that live at this level (1-4, 12, 13). Tiny model, fp32."""
import torch

from nemo_duplex.models.config import SamplingParams
from nemo_duplex.models.model import offline_inference
from nemo_duplex.serving.frame_step import admit, frame_step, special_ids, stream_inference
from nemo_duplex.serving.state import allocate_call_state


def test_state_dict_keys_are_official(tiny):
    model, *_ = tiny
    keys = set(model.state_dict())
    prefixes = {k.split(".")[0] for k in keys}
    assert prefixes == {"stt_model", "tts_model"}
    for k in ["stt_model.embed_tokens.weight", "stt_model.lm_head.weight", "stt_model.function_head.weight",
              "stt_model.llm.norm_f.weight", "stt_model.perception.proj.weight", "stt_model.perception.proj.bias",
              "stt_model.perception.preprocessor.featurizer.fb", "tts_model.audio_prompt_latents.Aria",
              "tts_model.codec_silence_tokens", "tts_model._control_codes", "tts_model.tts_model.rvq_embs",
              "tts_model.audio_codec.prvq.mus_list.0", "stt_model.rnnt_joint.joint_net.2.weight"]:
        assert k in keys, k


def test_fusion_weights_and_order(tiny):
    """Pitfall 2: the function channel has weight 2 and the previous function token feeds back."""
    model, *_ = tiny
    H = model.cfg.llm.hidden_size
    a = torch.randn(3, H)
    text = torch.tensor([5, 40, 12])
    func = torch.tensor([12, 7, 33])
    E = model.stt_model.embed_tokens.weight
    expected = a * 1.0 + E[text] * 1.0 + E[func] * 2.0
    assert torch.allclose(model.fuse(a, text, func), expected, atol=1e-6)
    assert not torch.allclose(model.fuse(a, text, func), a + E[text] + E[func], atol=1e-3)


def test_prompt_rides_the_audio_channel(tiny):
    """Pitfall 3: prompt tokens on the user-audio channel; text and function channels PAD; nothing sampled."""
    model, tok, *_ = tiny
    ids = model.prompt_ids(tok, "You are a helpful voice assistant.")
    assert ids[0] == 1 and ids[-1] == 2
    E = model.stt_model.embed_tokens.weight
    pad = E[12]
    x = model.prompt_embeddings(ids)
    assert torch.allclose(x, E[ids] + pad + 2.0 * pad, atol=1e-6)


def test_first_frame_is_fused_with_pad_never_bos(tiny, example_clip):
    """Pitfall 1: frame 0's text channel is PAD (NeMo's _get_bos_embedding returns PAD), in streaming too."""
    model, *_ = tiny
    st = allocate_call_state(model, 1, 4, torch.device("cpu"), max_prompt_tokens=0)
    admit(model, st, 0, None, 0, SamplingParams())
    assert int(st.prev_text[0]) == 12 and int(st.prev_func[0]) == 12
    res = stream_inference(model, example_clip[:1280 * 2])
    # recompute frame 0 by hand from the offline encoder: input = a_0 + E(PAD) + 2 E(PAD)
    enc, _ = model.perception(example_clip[None, :1280 * 2], torch.tensor([1280 * 2]))
    a0 = model.perception.project(enc[0, :1])
    pad = torch.tensor([12])
    h_pad = model.llm(model.fuse(a0, pad, pad)[None])[0, -1:]
    h_bos = model.llm(model.fuse(a0, torch.tensor([1]), pad)[None])[0, -1:]
    top_pad = model.heads(h_pad)[0].topk(2).values
    assert torch.allclose(res.text_logits_top2[0], top_pad[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(model.heads(h_bos)[0].topk(2).values[0], top_pad[0], rtol=1e-4, atol=1e-4)


def test_offline_reference_shapes_and_zero_first_codes(tiny, example_clip):
    """Pitfalls 12 and 13: offline perception gives K+1 frames for K*1280 samples; frame 0's codes are
    all zero and never generated; the one-shot decode covers all P + T frames (prompt region included)."""
    model, tok, *_ = tiny
    K = 6
    clip = example_clip[: 1280 * K]
    res = offline_inference(model, clip)
    T = res.text_tokens.shape[0]
    assert T == K + 1
    assert (res.codes[0] == 0).all() and (res.codes[1:] < model.cfg.talker.codebook_size).all()
    assert res.wav.shape[0] == T * 1764
    ids = model.prompt_ids(tok, "Be brief.")
    res_p = offline_inference(model, clip, ids)
    P = ids.shape[0]
    assert res_p.text_tokens.shape[0] == K + 1
    assert res_p.wav.shape[0] == (P + K + 1) * 1764


def test_eos_does_not_stop_generation(tiny, example_clip):
    """Pitfall 4: EOS is a per-frame token; generation runs one step per input frame regardless."""
    model, *_ = tiny
    head = model.stt_model.lm_head.weight
    saved = head.detach().clone()
    try:
        with torch.no_grad():
            head[2] += 50 * head[12].sign()    # push EOS's logit up for typical hidden states
        res = stream_inference(model, example_clip[: 1280 * 5])
    finally:
        with torch.no_grad():
            head.copy_(saved)
    assert res.text_tokens.shape[0] == 5 and res.wav.shape[0] == 5 * 1764


def test_offline_and_streaming_agree_on_shared_frames(tiny, example_clip):
    """Both modes' text tokens agree frame for frame on the frames they share, and the
    streaming WAV is exactly 1764 samples per frame. With and without a system prompt."""
    model, tok, *_ = tiny
    clip = example_clip[: 1280 * 24 + 700]   # not a multiple of 1280
    for prompt in (None, "Be brief."):
        ids = model.prompt_ids(tok, prompt)
        off = offline_inference(model, clip, ids)
        st = stream_inference(model, clip, ids)
        K = st.text_tokens.shape[0]
        assert K == 25 and st.wav.shape[0] == K * 1764
        shared = min(K, off.text_tokens.shape[0]) - 1   # the last streaming frame holds zero padding
        assert torch.equal(off.text_tokens[:shared], st.text_tokens[:shared]), prompt
        assert torch.equal(off.function_tokens[:shared], st.function_tokens[:shared]), prompt
        # the text is not constant (the test would be weak if the tiny model always said PAD)
        assert off.text_tokens[:shared].unique().numel() > 1


def test_frame_step_padding_rows_touch_only_the_sink(tiny, example_clip):
    model, *_ = tiny
    st = allocate_call_state(model, 2, 8, torch.device("cpu"), max_prompt_tokens=0)
    admit(model, st, 0, None, 0, SamplingParams())
    admit(model, st, 1, None, 1, SamplingParams())
    specials = special_ids(model, torch.device("cpu"))
    frame_step(model, st, torch.tensor([0, 1]), example_clip[:2560].view(2, 1280), torch.tensor([-1, -1]), specials)
    before = {k: v.clone() for k, v in st.llm.__dict__.items() if isinstance(v, torch.Tensor)}
    frame_step(model, st, torch.tensor([st.sink, st.sink]), torch.randn(2, 1280), torch.tensor([-1, -1]), specials)
    for k, v in st.llm.__dict__.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v[:, :2], before[k][:, :2]), k


def test_mel_front_end_uses_checkpoint_tables_in_fp32():
    """Pitfall 10: mel features in fp32 from the checkpoint's `fb` and `window` (not recomputed), even
    when the encoder runs in bf16."""
    import dataclasses

    from nemo_duplex.models.config import DtypeConfig, tiny_config
    from nemo_duplex.models.model import VoiceChat

    cfg = dataclasses.replace(tiny_config(), dtype=DtypeConfig(encoder="bf16"))
    model = VoiceChat(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    model.cast_for_inference()
    fe = model.perception.preprocessor
    assert fe.featurizer.fb.dtype == torch.float32 and fe.featurizer.window.dtype == torch.float32
    audio = torch.randn(1, 4000) * 0.1
    mel, _ = fe(audio, torch.tensor([4000]))
    assert mel.dtype == torch.float32
    with torch.no_grad():
        fe.featurizer.fb.mul_(2.0)     # a checkpoint with other tables gives other features: ln(2) apart
    mel2, n = fe(audio, torch.tensor([4000]))
    valid = (mel2 - mel)[..., : int(n[0])][mel[..., : int(n[0])] > -10]   # away from the 2^-24 log guard
    assert valid.numel() > 1000 and torch.allclose(valid, torch.full_like(valid, 0.6931472), atol=1e-3)
