"""config.json <-> ModelConfig: the official checkpoint's nested NeMo config (spec 6.2) and the LLM's HF
`nemotron_h` config (spec 3.1, 12.4), both ways.

A checkpoint directory holds
  config.json                       nested NeMo config (spec 6.2); no LLM dims in it (spec 12.4)
  model.safetensors                 every tensor, or model.safetensors.index.json + shards (spec 6.1)
  <pretrained_llm>/config.json      HF `nemotron_h` config, when `pretrained_llm` names a local dir
  tokenizer.json                    the LLM tokenizer (not shipped with the release, spec 3.8)
  rnnt_tokenizer/vocab.json         RNN-T pieces (spec 2.10)
"""
from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path

from nemo_duplex.checkpoint.files import CheckpointError, has_weights, read_json, tensor_shapes
from nemo_duplex.models.config import CASConfig, GemmaConfig, LLMConfig, ModelConfig, TokenConfig

LOCAL_LLM_DIR = "llm"  # where random checkpoints put the HF nemotron_h config (`pretrained_llm: llm`)



def _gemma_backbone_config(g: GemmaConfig) -> dict:
    """HF `gemma3_text` keys (spec 4.1). Both the legacy rope keys and `layer_types` are written."""
    return {
        "model_type": "gemma3_text",
        "hidden_size": g.hidden_size,
        "intermediate_size": g.intermediate_size,
        "num_hidden_layers": g.num_hidden_layers,
        "num_attention_heads": g.num_attention_heads,
        "num_key_value_heads": g.num_key_value_heads,
        "head_dim": g.head_dim,
        "query_pre_attn_scalar": g.query_pre_attn_scalar,
        "sliding_window": g.sliding_window,
        "sliding_window_pattern": g.sliding_window_pattern,
        "layer_types": ["full_attention" if g.is_full_attention(i) else "sliding_attention"
                        for i in range(g.num_hidden_layers)],
        "rope_theta": g.rope_theta,
        "rope_local_base_freq": g.rope_local_base_freq,
        "rms_norm_eps": g.rms_norm_eps,
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "attention_bias": False,
    }


def _cas_encoder_config(c: CASConfig) -> dict:
    """T5Gemma-style encoder keys of the char-aware subword encoder (spec 4.2)."""
    return {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "query_pre_attn_scalar": c.query_pre_attn_scalar,
        "attn_logit_softcapping": c.attn_logit_softcapping,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "hidden_activation": "gelu_pytorch_tanh",
    }


def official_config(cfg: ModelConfig) -> dict:
    """The nested NeMo `config.json` of a checkpoint with this configuration (spec 6.2)."""
    fe, enc, r, t, tok = cfg.frontend, cfg.encoder, cfg.rnnt, cfg.talker, cfg.tokens
    preprocessor = {
        "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
        "sample_rate": fe.sample_rate,
        "window_size": fe.win_length / fe.sample_rate,
        "window_stride": fe.hop_length / fe.sample_rate,
        "window": "hann",
        "n_fft": fe.n_fft,
        "features": fe.n_mels,
        "normalize": "NA",  # spec 2.1: no normalisation (per_feature would break streaming)
        "log": True,
        "log_zero_guard_type": "add",
        "log_zero_guard_value": fe.log_zero_guard,
        "mag_power": 2.0,
        "dither": 0.0,  # inference-time value (spec 2.1)
        "pad_to": 0,
        "preemph": fe.preemph,
        "lowfreq": 0,
        "highfreq": None,
    }
    encoder = {
        "_target_": "nemo.collections.asr.modules.ConformerEncoder",
        "feat_in": fe.n_mels,
        "n_layers": enc.n_layers,
        "d_model": enc.d_model,
        "n_heads": enc.n_heads,
        "ff_expansion_factor": enc.ff_expansion_factor,
        "conv_kernel_size": enc.conv_kernel_size,
        "subsampling": "dw_striding",
        "subsampling_factor": enc.subsampling_factor,
        "subsampling_conv_channels": enc.subsampling_conv_channels,
        "causal_downsampling": True,
        "att_context_size": [enc.att_context_left, enc.att_context_right],
        "att_context_style": "chunked_limited",
        "conv_context_size": "causal",
        "conv_norm_type": "layer_norm",
        "xscaling": False,
        "use_bias": False,
        "self_attention_model": "rel_pos",
    }
    stt = {
        "pretrained_llm": cfg.pretrained_llm,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "use_function_head": cfg.llm.use_function_head,
        "predict_user_text": False,
        "duplex_user_channel_weight": cfg.user_channel_weight,
        "duplex_text_channel_weight": cfg.text_channel_weight,
        "duplex_function_channel_weight": cfg.function_channel_weight,
        "base_model_name": "backbone",  # release-generation names (spec 6.2, 12.4)
        "embed_tokens_name": "embeddings",
        "perception": {"preprocessor": preprocessor, "encoder": encoder, "modality_adapter": {},
                       "output_dim": enc.output_dim},
    }
    tts_config = {
        "backbone_type": "gemma3_text",
        "backbone_config": _gemma_backbone_config(t.backbone),
        "cas_config": {"backbone_type": "t5gemma",
                       "backbone_config": {"encoder": _cas_encoder_config(t.cas)},
                       "pretrained_tokenizer_name": cfg.pretrained_llm},
        "mog_head_config": {"num_predictions": t.mog.num_predictions, "low_rank": t.mog.low_rank,
                            "min_log_std": t.mog.min_log_std, "num_layers": t.mog.num_layers,
                            "intermediate_size": t.mog.intermediate_size, "eps": t.mog.eps},
        "latent_size": t.latent_size,
        "num_quantizers": t.num_quantizers,
        "codebook_size": t.codebook_size,
        "exponent": t.exponent,
        "num_delay_speech_tokens": 2,
        "disable_eos_prediction": True,
        "use_gated_fusion_for_text_audio": True,
        "use_subword_flag_emb": True,
        "use_bos_eos_emb": True,
        "use_audio_prompt_frozen_projection": True,
        "context_hidden_size": None,
        "random_target_masking": False,
    }
    c = cfg.codec
    speech_generation = {
        "pretrained_lm_name": cfg.pretrained_llm,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "inference_guidance_scale": t.guidance_scale,
        # spec 4.7 / 12.8: a float is top-p, an int is top-k
        "inference_top_p_or_k": int(t.top_k) if t.top_k > 0 else float(t.top_p),
        "inference_noise_scale": t.noise_scale,
        "inference_force_speech_silence_on_eos": t.force_silence_on_eos,
        "audio_codec_run_dtype": "float32",
        "codec_config": {"base_hidden_size": c.base_hidden_size, "channel_mult": list(c.channel_mult),
                         "rates": list(c.rates), "num_blocks": c.num_blocks, "kernel_size": c.kernel_size,
                         "latent_size": c.latent_size, "n_fft": c.n_fft, "hop_length": c.hop_length,
                         "groups": 1, "num_quantizers": c.num_quantizers, "codebook_size": c.codebook_size,
                         "wav_to_token_ratio": c.wav_to_token_ratio},
        "tts_config": tts_config,
    }
    model = {
        "stt": {"model": stt},
        "speech_generation": {"model": speech_generation,
                              "data": {"audio_prompt_duration": t.audio_prompt_duration}},
        "inference_speaker_name": t.speaker,
    }
    if r.present:
        model["_rnnt_merge_info"] = {
            "decoder_config": {"vocab_size": r.vocab_size,
                               "prednet": {"pred_hidden": r.pred_hidden, "pred_rnn_layers": r.pred_rnn_layers},
                               "blank_as_pad": True},
            "joint_config": {"num_classes": r.vocab_size,
                             "jointnet": {"encoder_hidden": enc.d_model, "pred_hidden": r.pred_hidden,
                                          "joint_hidden": r.joint_hidden, "activation": "relu"}},
            "decoding": {"strategy": "greedy_batch", "greedy": {"max_symbols": r.max_symbols_per_step}},
        }
    return {
        "data": {"source_sample_rate": cfg.source_sample_rate, "target_sample_rate": cfg.target_sample_rate,
                 "frame_length": cfg.frame_length},
        "model": model,
    }


def hf_llm_config(llm: LLMConfig, tokens: TokenConfig = TokenConfig()) -> dict:
    """HF `nemotron_h` config.json for the LLM (spec 3.1)."""
    return {
        "model_type": "nemotron_h",
        "architectures": ["NemotronHForCausalLM"],
        "hidden_size": llm.hidden_size,
        "intermediate_size": llm.intermediate_size,
        "num_hidden_layers": llm.num_layers,
        "hybrid_override_pattern": llm.hybrid_override_pattern,
        "num_attention_heads": llm.num_attention_heads,
        "num_key_value_heads": llm.num_key_value_heads,
        "head_dim": llm.head_dim,
        "mamba_num_heads": llm.mamba_num_heads,
        "mamba_head_dim": llm.mamba_head_dim,
        "ssm_state_size": llm.ssm_state_size,
        "n_groups": llm.n_groups,
        "conv_kernel": llm.conv_kernel,
        "vocab_size": llm.vocab_size,
        "layer_norm_epsilon": llm.layer_norm_epsilon,
        "mamba_hidden_act": "silu",
        "mlp_hidden_act": "relu2",
        "use_conv_bias": True,
        "use_bias": False,
        "mlp_bias": False,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "chunk_size": 128,
        "max_position_embeddings": 131072,
        "bos_token_id": tokens.bos_id,
        "eos_token_id": tokens.pad_id,  # the stock tokenizer's eos is <SPECIAL_12> (spec 3.8)
        "pad_token_id": 0,
    }


_BLOCK_LETTER = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-"}


def llm_config_from_hf(d: dict) -> LLMConfig:
    """LLMConfig from an HF `nemotron_h` config.json (either pattern spelling)."""
    if "hybrid_override_pattern" in d:
        pattern = d["hybrid_override_pattern"]
    elif "layers_block_type" in d:  # transformers 5.x spelling
        pattern = "".join(_BLOCK_LETTER[b] for b in d["layers_block_type"])
    else:
        raise CheckpointError("LLM config.json has neither hybrid_override_pattern nor layers_block_type")
    if "num_hidden_layers" in d and int(d["num_hidden_layers"]) != len(pattern):
        raise CheckpointError(f"LLM config.json: num_hidden_layers {d['num_hidden_layers']} != "
                              f"len(hybrid_override_pattern) {len(pattern)}")
    base = LLMConfig()
    values = {f: d[f] for f in ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "mamba_num_heads", "mamba_head_dim",
                                "ssm_state_size", "n_groups", "conv_kernel", "layer_norm_epsilon") if f in d}
    if "head_dim" not in d and "hidden_size" in d and "num_attention_heads" in d:
        values["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    if "layer_norm_epsilon" not in d and "rms_norm_eps" in d:
        values["layer_norm_epsilon"] = d["rms_norm_eps"]
    return _updated(base, values, hybrid_override_pattern=pattern)


def _coerce(old, new):
    """A config value in the type of the dataclass field it replaces (JSON turns 256.0 into 256 and
    lists into lists)."""
    if new is None or old is None:
        return new
    if isinstance(old, bool):
        return bool(new)
    if isinstance(old, float):
        return float(new)
    if isinstance(old, int):
        return int(new)
    if isinstance(old, list):
        return list(new)
    return new


def _updated(dc, values: dict, **extra):
    """dataclasses.replace with type coercion; keys whose value is missing keep dc's value."""
    fields = {f.name for f in dataclasses.fields(dc)}
    changes = {k: _coerce(getattr(dc, k), v) for k, v in values.items() if k in fields}
    changes.update(extra)
    return replace(dc, **changes)


def _pick(d: dict, mapping: dict[str, str]) -> dict:
    """{field: d[official_key]} for the official keys present in d."""
    return {field: d[key] for field, key in mapping.items() if key in d}


def _gemma_from_official(d: dict, base: GemmaConfig) -> GemmaConfig:
    values = _pick(d, {f: f for f in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                      "num_attention_heads", "num_key_value_heads", "head_dim",
                                      "query_pre_attn_scalar", "sliding_window", "sliding_window_pattern",
                                      "rope_theta", "rope_local_base_freq", "rms_norm_eps")})
    rope = d.get("rope_parameters") or {}  # transformers 5.x spelling of the two RoPE bases
    if "rope_theta" not in values and "full_attention" in rope:
        values["rope_theta"] = rope["full_attention"]["rope_theta"]
    if "rope_local_base_freq" not in values and "sliding_attention" in rope:
        values["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    if "sliding_window_pattern" not in values:
        if "_sliding_window_pattern" in d:
            values["sliding_window_pattern"] = d["_sliding_window_pattern"]
        elif "full_attention" in d.get("layer_types", []):
            values["sliding_window_pattern"] = d["layer_types"].index("full_attention") + 1
    return _updated(base, values)


def config_from_official(official: dict, ckpt_dir: str | Path, base: ModelConfig,
                         llm_config_json: str | Path | None = None) -> ModelConfig:
    """Inverse of `official_config`. What config.json does not carry (dtypes, front-end variant,
    `weights`, RNN-T... defaults that are absent) keeps `base`'s values. LLM dims come from
    `llm_config_json` when given (the HF config of `pretrained_llm`, found through the hub:
    hub.find_file), else `<ckpt_dir>/<pretrained_llm>/config.json` if that exists, else
    Nemotron-Nano-9B-v2's (spec 12.4).
    `cas.num_chars` and (when config.json does not name it) the speaker come from the safetensors
    header when the weights are there."""
    ckpt_dir = Path(ckpt_dir)
    model = official.get("model", {})
    stt = model.get("stt", {}).get("model", {})
    sg = model.get("speech_generation", {})
    gen = sg.get("model", {})
    tts = gen.get("tts_config", {})
    perception = stt.get("perception", {})
    pre, enc_d = perception.get("preprocessor", {}), perception.get("encoder", {})
    shapes = tensor_shapes(ckpt_dir) if has_weights(ckpt_dir) else None

    # Front end (spec 2.1): window_size/stride are seconds in the NeMo config.
    fe = base.frontend
    sr = int(pre.get("sample_rate", fe.sample_rate))
    fe_values = _pick(pre, {"sample_rate": "sample_rate", "n_fft": "n_fft", "n_mels": "features",
                            "preemph": "preemph", "log_zero_guard": "log_zero_guard_value"})
    if "window_size" in pre:
        fe_values["win_length"] = round(float(pre["window_size"]) * sr)
    if "window_stride" in pre:
        fe_values["hop_length"] = round(float(pre["window_stride"]) * sr)
    frontend = _updated(fe, fe_values)

    enc_values = _pick(enc_d, {f: f for f in ("n_layers", "d_model", "n_heads", "ff_expansion_factor",
                                              "conv_kernel_size", "subsampling_conv_channels",
                                              "subsampling_factor")})
    if "att_context_size" in enc_d:
        enc_values["att_context_left"], enc_values["att_context_right"] = enc_d["att_context_size"]
    if "output_dim" in perception:
        enc_values["output_dim"] = perception["output_dim"]
    encoder = _updated(base.encoder, enc_values)

    # RNN-T (spec 2.10); absent in nemo-toolkit 3.0.0 configs (spec 12.1).
    merge = model.get("_rnnt_merge_info", official.get("_rnnt_merge_info"))
    if merge:
        dec, joint = merge.get("decoder_config", {}), merge.get("joint_config", {})
        r_values = {"present": True}
        r_values.update(_pick(dec, {"vocab_size": "vocab_size"}))
        r_values.update(_pick(dec.get("prednet", {}), {"pred_hidden": "pred_hidden",
                                                       "pred_rnn_layers": "pred_rnn_layers"}))
        r_values.update(_pick(joint.get("jointnet", {}), {"joint_hidden": "joint_hidden"}))
        r_values.update(_pick(merge.get("decoding", {}).get("greedy", {}), {"max_symbols_per_step": "max_symbols"}))
        rnnt = _updated(base.rnnt, r_values)
    else:
        rnnt = replace(base.rnnt, present=False)

    # LLM (spec 12.4): dims from the named local HF dir, else the built-in Nano-9B-v2 dims.
    pretrained_llm = stt.get("pretrained_llm", base.pretrained_llm)
    llm_json = Path(llm_config_json) if llm_config_json is not None else ckpt_dir / pretrained_llm / "config.json"
    llm = llm_config_from_hf(read_json(llm_json)) if llm_json.is_file() else LLMConfig()
    if "use_function_head" in stt:
        use_function_head = bool(stt["use_function_head"])
    elif shapes is not None:
        use_function_head = "stt_model.function_head.weight" in shapes
    else:
        use_function_head = False  # nemo-toolkit 3.0.0 generation (spec 12.1)
    llm = replace(llm, use_function_head=use_function_head)
    # Both NeMo generations name the HF attributes (spec 12.4); the checkpoint keys do not depend on
    # them (`stt_model.llm.*`, `stt_model.embed_tokens.*`), so they are accepted and not used.
    _ = stt.get("base_model_name", stt.get("llm_attr_name")), stt.get("embed_tokens_name",
                                                                        stt.get("embed_tokens_attr_name"))

    # Talker (spec 4).
    t = base.talker
    backbone = _gemma_from_official(tts.get("backbone_config", {}), t.backbone)
    cas_enc = tts.get("cas_config", {}).get("backbone_config", {}).get("encoder", {})
    cas = _updated(t.cas, _pick(cas_enc, {f: f for f in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                         "num_attention_heads", "num_key_value_heads",
                                                         "head_dim", "query_pre_attn_scalar",
                                                         "attn_logit_softcapping", "rope_theta",
                                                         "rms_norm_eps")}))
    subword_table = "tts_model.tts_model.embed_subword.embed_tokens.weight"
    if shapes is not None and subword_table in shapes:
        cas = replace(cas, num_chars=shapes[subword_table][0] - 1)  # last row = the pad char (spec 4.2)
    mog = _updated(t.mog, tts.get("mog_head_config", {}))
    t_values = _pick(tts, {f: f for f in ("latent_size", "num_quantizers", "codebook_size", "exponent")})
    t_values.update(_pick(gen, {"guidance_scale": "inference_guidance_scale",
                                "noise_scale": "inference_noise_scale",
                                "force_silence_on_eos": "inference_force_speech_silence_on_eos"}))
    if "inference_top_p_or_k" in gen:
        v = gen["inference_top_p_or_k"]
        if isinstance(v, int) and not isinstance(v, bool):
            t_values["top_k"] = v
        else:
            t_values.update(top_p=v, top_k=0)
    t_values.update(_pick(sg.get("data", {}), {"audio_prompt_duration": "audio_prompt_duration"}))
    if "inference_speaker_name" in model:
        t_values["speaker"] = model["inference_speaker_name"]
    elif shapes is not None:
        speakers = sorted(k.rsplit(".", 1)[1] for k in shapes if k.startswith("tts_model.audio_prompt_latents."))
        if speakers and t.speaker not in speakers:
            t_values["speaker"] = speakers[0]
    talker = _updated(t, t_values, backbone=backbone, cas=cas, mog=mog)

    codec = _updated(base.codec, gen.get("codec_config", {}))
    tokens = _updated(base.tokens, _pick(stt, {"bos_token": "bos_token", "eos_token": "eos_token",
                                               "pad_token": "pad_token"}))
    data = official.get("data", {})
    top = _pick(data, {f: f for f in ("source_sample_rate", "target_sample_rate", "frame_length")})
    top.update(_pick(stt, {"user_channel_weight": "duplex_user_channel_weight",
                           "text_channel_weight": "duplex_text_channel_weight",
                           "function_channel_weight": "duplex_function_channel_weight"}))
    return _updated(base, top, frontend=frontend, encoder=encoder, rnnt=rnnt, llm=llm, talker=talker,
                    codec=codec, tokens=tokens, pretrained_llm=pretrained_llm)


def read_config(ckpt_dir: str | Path, base: ModelConfig) -> ModelConfig:
    """The checkpoint's configuration: its config.json over `base` (config_from_official), with the LLM's
    HF config found through `pretrained_llm` (a local directory or the hub's cache)."""
    from nemo_duplex.checkpoint.hub import find_file

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "config.json").is_file():
        raise CheckpointError(f"no config.json in {ckpt_dir}")
    official = read_json(ckpt_dir / "config.json")
    pretrained_llm = official.get("model", {}).get("stt", {}).get("model", {}).get("pretrained_llm",
                                                                                   base.pretrained_llm)
    return config_from_official(official, ckpt_dir, base, find_file("config.json", ckpt_dir, pretrained_llm))
