"""The official checkpoint layout (spec 6): `config.json` <-> `ModelConfig`, a strict safetensors
loader, the checkpoint writer and seeded random checkpoints.

A checkpoint directory holds
  config.json                       nested NeMo config (spec 6.2); no LLM dims in it (spec 12.4)
  model.safetensors                 every tensor, or model.safetensors.index.json + shards (spec 6.1)
  <pretrained_llm>/config.json      HF `nemotron_h` config, when `pretrained_llm` names a local dir
  tokenizer.json                    the LLM tokenizer (not shipped with the release, spec 3.8)
  rnnt_tokenizer/vocab.json         RNN-T pieces (spec 2.10)

Tensors are read one at a time (`safe_open`) straight into parameters that were created empty on the
target device, so loading never holds a second copy of the 44 GB model.
"""
from __future__ import annotations

import dataclasses
import json
import re
import struct
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from nemo_duplex.models.config import CASConfig, GemmaConfig, LLMConfig, ModelConfig, TokenConfig
from nemo_duplex.models.tokenizer import RNNTVocab, Tokenizer, make_byte_level_tokenizer, make_tiny_rnnt_vocab

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LOCAL_LLM_DIR = "llm"  # where random checkpoints put the HF nemotron_h config (`pretrained_llm: llm`)


class CheckpointError(RuntimeError):
    """A checkpoint that does not fit the model: the message lists every problem at once."""


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig (spec 6.2, 12.4)
# ---------------------------------------------------------------------------------------------

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


def _read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


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
    llm = llm_config_from_hf(_read_json(llm_json)) if llm_json.is_file() else LLMConfig()
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


# ---------------------------------------------------------------------------------------------
# safetensors: headers, a streaming writer
# ---------------------------------------------------------------------------------------------

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}


def read_header(path: str | Path) -> dict[str, dict]:
    """{key: {"dtype", "shape", "data_offsets"}} of one safetensors file, without reading tensors."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def has_weights(ckpt_dir: str | Path) -> bool:
    d = Path(ckpt_dir)
    return (d / SINGLE_FILE).is_file() or (d / INDEX_FILE).is_file()


def checkpoint_files(ckpt_dir: str | Path) -> dict[str, Path]:
    """{key: the safetensors file holding it}: the single file, or the index's `weight_map` (spec 6.1)."""
    d = Path(ckpt_dir)
    if (d / SINGLE_FILE).is_file():
        return {k: d / SINGLE_FILE for k in read_header(d / SINGLE_FILE)}
    if (d / INDEX_FILE).is_file():
        weight_map = _read_json(d / INDEX_FILE)["weight_map"]
        files = {k: d / name for k, name in weight_map.items()}
        for shard in sorted(set(files.values())):  # the index must agree with the shards
            if not shard.is_file():
                raise CheckpointError(f"{INDEX_FILE} names {shard.name}, which does not exist in {d}")
            in_shard = set(read_header(shard))
            absent = [k for k, f in files.items() if f == shard and k not in in_shard]
            if absent:
                raise CheckpointError(f"{INDEX_FILE} maps {len(absent)} key(s) to {shard.name} that it does "
                                      f"not hold: {absent[:10]}")
        return files
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {d}")


def tensor_shapes(ckpt_dir: str | Path) -> dict[str, list[int]]:
    """{key: shape} of every checkpoint tensor, from the headers only."""
    headers = {f: read_header(f) for f in set(checkpoint_files(ckpt_dir).values())}
    return {k: list(v["shape"]) for h in headers.values() for k, v in h.items()}


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    """safetensors file written tensor by tensor (no full in-memory copy of the model): 8-byte header
    length, JSON header padded to 8 bytes, then the raw little-endian data in header order."""
    header, offset = {}, 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in names:
            f.write(_tensor_bytes(tensors[name]))


def _shards(tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[list[str]]:
    """Keys in sorted order, cut into consecutive groups of at most shard_bytes (a bigger tensor alone)."""
    groups, current, size = [], [], 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if current and size + n > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        groups.append(current)
    return groups


# ---------------------------------------------------------------------------------------------
# Strict loading
# ---------------------------------------------------------------------------------------------

def _is_float(dtype) -> bool:
    return dtype.is_floating_point if isinstance(dtype, torch.dtype) else dtype in ("F64", "F32", "F16", "BF16",
                                                                                   "F8_E4M3", "F8_E5M2")


def _problems_message(ckpt_dir, missing, unexpected, misshaped, mistyped) -> str:
    counts = [f"{len(missing)} missing", f"{len(unexpected)} unexpected", f"{len(misshaped)} mis-shaped"]
    if mistyped:
        counts.append(f"{len(mistyped)} of the wrong kind (integer vs float)")
    lines = [f"checkpoint {ckpt_dir} does not match the model: " + ", ".join(counts) + " key(s)"]
    if missing:
        lines += [f"missing keys ({len(missing)}): in the model, not in the checkpoint"] + [f"  {k}" for k in missing]
    if unexpected:
        lines += [f"unexpected keys ({len(unexpected)}): in the checkpoint, not in the model"] + [
            f"  {k}" for k in unexpected]
    if misshaped:
        lines += [f"mis-shaped keys ({len(misshaped)}):"] + [
            f"  {k}: model expects {list(e)}, checkpoint has {list(f)}" for k, e, f in misshaped]
    if mistyped:
        lines += [f"wrong kind ({len(mistyped)}):"] + [
            f"  {k}: model {e}, checkpoint {f}" for k, e, f in mistyped]
    return "\n".join(lines)


@torch.no_grad()
def load_state(model: nn.Module, ckpt_dir: str | Path) -> None:
    """Copy every checkpoint tensor into `model`'s parameters and persistent buffers, strictly: ALL
    missing, unexpected, mis-shaped (and int/float mismatched) keys are reported in one CheckpointError
    before anything is copied. Floats are cast to each parameter's dtype; int buffers stay int."""
    targets = model.state_dict(keep_vars=True)  # the live tensors, under the official keys
    files = checkpoint_files(ckpt_dir)
    headers = {f: read_header(f) for f in set(files.values())}
    found = {k: headers[f][k] for k, f in files.items()}

    missing = sorted(set(targets) - set(found))
    unexpected = sorted(set(found) - set(targets))
    misshaped, mistyped = [], []
    for k in sorted(set(targets) & set(found)):
        expected, stored = list(targets[k].shape), list(found[k]["shape"])
        if expected != stored:
            misshaped.append((k, expected, stored))
        elif _is_float(targets[k].dtype) != _is_float(found[k]["dtype"]):
            mistyped.append((k, targets[k].dtype, found[k]["dtype"]))
    if missing or unexpected or misshaped or mistyped:
        raise CheckpointError(_problems_message(ckpt_dir, missing, unexpected, misshaped, mistyped))

    by_file: dict[Path, list[str]] = {}
    for k, f in files.items():
        by_file.setdefault(f, []).append(k)
    for f, keys in sorted(by_file.items()):
        devices = {targets[k].device for k in keys}
        # read straight onto the GPU when the whole file goes there (the dtype cast then runs there too)
        device = str(devices.pop()) if len(devices) == 1 else "cpu"
        with safe_open(str(f), framework="pt", device=device) as st:
            for k in sorted(keys):
                targets[k].copy_(st.get_tensor(k))  # copy_ casts dtype and moves to the param's device
    for module in model.modules():   # tables derived from the old weights are stale (e.g. EarTTS.text_table)
        if hasattr(module, "weights_loaded"):
            module.weights_loaded()


# ---------------------------------------------------------------------------------------------
# Dimension checks (spec 12.4: every LLM / talker dimension against the tensor shapes)
# ---------------------------------------------------------------------------------------------

def expected_shapes(cfg: ModelConfig) -> list[tuple[str, str, list[int]]]:
    """(config fields it checks, key, shape) for the tensors that pin the LLM / talker / codec dims."""
    llm, t, enc = cfg.llm, cfg.talker, cfg.encoder
    H, V = llm.hidden_size, llm.vocab_size
    out = [("llm.vocab_size, llm.hidden_size", "stt_model.embed_tokens.weight", [V, H]),
           ("llm.vocab_size, llm.hidden_size", "stt_model.lm_head.weight", [V, H]),
           ("llm.hidden_size", "stt_model.llm.norm_f.weight", [H]),
           ("encoder.output_dim, encoder.d_model", "stt_model.perception.proj.weight", [enc.output_dim, enc.d_model])]
    if llm.use_function_head:
        out.append(("llm.vocab_size, llm.hidden_size", "stt_model.function_head.weight", [V, H]))
    for i, kind in enumerate(llm.hybrid_override_pattern):
        p = f"stt_model.llm.layers.{i}.mixer."
        if kind == "M":
            what = (f"layer {i} 'M': mamba_num_heads, mamba_head_dim, n_groups, ssm_state_size, "
                    "conv_kernel, hidden_size")
            d_in = llm.mamba_d_inner
            out += [(what, p + "in_proj.weight", [2 * d_in + 2 * llm.n_groups * llm.ssm_state_size
                                                  + llm.mamba_num_heads, H]),
                    (what, p + "conv1d.weight", [llm.mamba_conv_dim, 1, llm.conv_kernel]),
                    (what, p + "A_log", [llm.mamba_num_heads]),
                    (what, p + "norm.weight", [d_in]),
                    (what, p + "out_proj.weight", [H, d_in])]
        elif kind == "*":
            what = f"layer {i} '*': num_attention_heads, num_key_value_heads, head_dim, hidden_size"
            out += [(what, p + "q_proj.weight", [llm.num_attention_heads * llm.head_dim, H]),
                    (what, p + "k_proj.weight", [llm.num_key_value_heads * llm.head_dim, H]),
                    (what, p + "o_proj.weight", [H, llm.num_attention_heads * llm.head_dim])]
        else:
            what = f"layer {i} '-': intermediate_size, hidden_size"
            out += [(what, p + "up_proj.weight", [llm.intermediate_size, H]),
                    (what, p + "down_proj.weight", [H, llm.intermediate_size])]

    tp = "tts_model.tts_model."
    b, cas, mog = t.backbone, t.cas, t.mog
    for i in range(b.num_hidden_layers):
        p = f"{tp}backbone.layers.{i}."
        what = "talker.backbone heads / head_dim / hidden / intermediate"
        out += [(what, p + "self_attn.q_proj.weight", [b.num_attention_heads * b.head_dim, b.hidden_size]),
                (what, p + "self_attn.k_proj.weight", [b.num_key_value_heads * b.head_dim, b.hidden_size]),
                (what, p + "self_attn.q_norm.weight", [b.head_dim]),
                (what, p + "mlp.gate_proj.weight", [b.intermediate_size, b.hidden_size])]
    for i in range(cas.num_hidden_layers):
        p = f"{tp}embed_subword.backbone.encoder.layers.{i}."
        what = "talker.cas heads / head_dim / hidden / intermediate"
        out += [(what, p + "self_attn.q_proj.weight", [cas.num_attention_heads * cas.head_dim, cas.hidden_size]),
                (what, p + "self_attn.k_proj.weight", [cas.num_key_value_heads * cas.head_dim, cas.hidden_size]),
                (what, p + "mlp.gate_proj.weight", [cas.intermediate_size, cas.hidden_size])]
    out += [
        ("talker.backbone.hidden_size", f"{tp}backbone.norm.weight", [b.hidden_size]),
        ("talker.latent_size", f"{tp}embed_code.weight", [b.hidden_size, t.latent_size]),
        ("talker.num_quantizers, codebook_size, latent_size", f"{tp}rvq_embs",
         [t.num_quantizers, t.codebook_size, t.latent_size]),
        ("talker.cas.num_chars", f"{tp}embed_subword.embed_tokens.weight", [cas.num_chars + 1, cas.hidden_size]),
        ("talker.cas.hidden_size", f"{tp}embed_subword.proj_embedding.weight", [b.hidden_size, cas.hidden_size]),
        ("llm.vocab_size", f"{tp}embed_subword.bos_eos_emb.special_flags", [V]),
        ("talker.mog.num_predictions", f"{tp}mog_head.proj_logits.weight", [mog.num_predictions, b.hidden_size]),
        ("talker.mog.num_predictions, low_rank", f"{tp}mog_head.proj_mus.weight",
         [mog.num_predictions * mog.low_rank, b.hidden_size]),
        ("talker.mog low_rank, latent_size", f"{tp}mog_head.low_mat",
         [mog.num_predictions, t.latent_size, mog.low_rank]),
        ("talker.mog.intermediate_size", f"{tp}mog_head.mlp_stack.0.mlp.gate_proj.weight",
         [mog.intermediate_size, b.hidden_size]),
        ("talker.mog.num_layers", f"{tp}mog_head.mlp_stack.{mog.num_layers}.weight", [b.hidden_size]),
        ("talker.speaker, audio_prompt_duration", f"tts_model.audio_prompt_latents.{t.speaker}",
         [1, cfg.prompt_frames, b.hidden_size]),
        ("talker.num_quantizers", "tts_model.codec_silence_tokens", [t.num_quantizers]),
        ("codec.codebook_size, latent_size", "tts_model.audio_codec.prvq.mus_list.0",
         [cfg.codec.codebook_size, cfg.codec.latent_size]),
    ]
    return out


def check_dimensions(cfg: ModelConfig, shapes: dict[str, list[int]]) -> None:
    """Raise one CheckpointError naming every config dimension the checkpoint's tensors contradict,
    and every count (LLM layers, talker layers) that differs."""
    problems = []
    if cfg.encoder.output_dim != cfg.llm.hidden_size:
        problems.append(f"encoder.output_dim {cfg.encoder.output_dim} != llm.hidden_size {cfg.llm.hidden_size}")
    if (cfg.talker.latent_size, cfg.talker.num_quantizers, cfg.talker.codebook_size) != (
            cfg.codec.latent_size, cfg.codec.num_quantizers, cfg.codec.codebook_size):
        problems.append("talker and codec disagree on latent_size / num_quantizers / codebook_size")
    for what, key, shape in expected_shapes(cfg):
        if key not in shapes:
            problems.append(f"{key} (checks {what}): not in the checkpoint")
        elif list(shapes[key]) != shape:
            problems.append(f"{key} (checks {what}): config implies {shape}, checkpoint has {list(shapes[key])}")
    counts = [("llm layers (len(hybrid_override_pattern))", r"stt_model\.llm\.layers\.(\d+)\.", cfg.llm.num_layers),
              ("talker.backbone.num_hidden_layers", r"tts_model\.tts_model\.backbone\.layers\.(\d+)\.",
               cfg.talker.backbone.num_hidden_layers),
              ("talker.cas.num_hidden_layers", r"tts_model\.tts_model\.embed_subword\.backbone\.encoder\.layers\.(\d+)\.",
               cfg.talker.cas.num_hidden_layers)]
    for what, pattern, n in counts:
        found = {int(m.group(1)) for k in shapes if (m := re.match(pattern, k))}
        if found and found != set(range(n)):
            problems.append(f"{what} = {n} in the config, checkpoint has layers {min(found)}..{max(found)} "
                            f"({len(found)} of them)")
    if problems:
        raise CheckpointError("checkpoint dimensions disagree with its configuration:\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------------------------------------
# Building, loading, writing whole models
# ---------------------------------------------------------------------------------------------

@contextmanager
def _parameters_on_meta():
    """Inside: every parameter registered on a module is moved to the meta device (no memory, no
    init cost), while buffers stay real, so buffers computed in __init__ (mel filterbank, RoPE tables)
    keep their values. A parameter allocated with torch.empty first costs nothing (lazy pages)."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _materialise(model: nn.Module, device: torch.device) -> None:
    """Replace meta parameters by uninitialised ones on `device` (tied parameters stay tied) and move
    buffers there. setattr (not _parameters[...] =) keeps e.g. nn.LSTM's flat weight list in sync."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad) \
                    if p.device.type == "meta" else p
            setattr(module, name, made[id(p)])
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = buf.to(device)
    model.to(device)  # lets modules refresh device-dependent state (nn.LSTM re-flattens its weights)


def build_empty_model(cfg: ModelConfig, device: str | torch.device):
    """VoiceChat(cfg) with uninitialised parameters on `device` (in the per-part dtypes) and real
    buffers; every persistent tensor must then be filled (load_state or init_weights)."""
    from nemo_duplex.models.model import VoiceChat  # model imports every part; keep this module importable without them

    with _parameters_on_meta():
        model = VoiceChat(cfg)
    if hasattr(model, "cast_for_inference"):
        model.cast_for_inference()  # free on meta: parameters are created directly in their final dtype
    _materialise(model, torch.device(device))
    return model.eval()


def _token_ids(cfg: ModelConfig, tokenizer: Tokenizer) -> ModelConfig:
    """The special ids are the tokenizer's ids of the config's special token strings (spec 3.8)."""
    t = cfg.tokens
    ids = {}
    for field, token in (("bos_id", t.bos_token), ("eos_id", t.eos_token), ("pad_id", t.pad_token)):
        i = tokenizer.token_to_id(token)
        if i is None:
            raise CheckpointError(f"the tokenizer has no {token!r} ({field}); is it Nemotron-Nano-9B-v2's?")
        ids[field] = i
    return replace(cfg, tokens=replace(t, **ids))


def find_tokenizer(ckpt_dir: Path, tokenizer: str | Path | None, pretrained_llm: str) -> Path:
    """The LLM's tokenizer.json: `tokenizer` (a file, a directory holding one, or a repo id) when given;
    else beside the checkpoint; else that of `pretrained_llm` (a directory relative to the checkpoint, or
    a repo id through the hub's cache: the release does not ship it, spec 3.8)."""
    from nemo_duplex.checkpoint.hub import describe_search, find_file, is_repo_id

    looked = []
    if tokenizer:
        c = Path(tokenizer).expanduser()
        c = c / "tokenizer.json" if c.is_dir() else c
        if c.is_file():
            return c
        if is_repo_id(str(tokenizer)) and (found := find_file("tokenizer.json", ckpt_dir, str(tokenizer))):
            return found
        raise CheckpointError(f"tokenizer={tokenizer}: not a tokenizer.json file, a directory holding one, or a "
                              f"repo id with one (looked for {describe_search('tokenizer.json', Path('.'), str(tokenizer))})")
    beside = ckpt_dir / "tokenizer.json"
    if beside.is_file():
        return beside
    looked.append(str(beside))
    found = find_file("tokenizer.json", ckpt_dir, pretrained_llm)
    if found is not None:
        return found
    looked.append(describe_search("tokenizer.json", ckpt_dir, pretrained_llm))
    raise CheckpointError(
        f"no LLM tokenizer: looked for {' and '.join(looked)}. The release checkpoint does not ship it "
        f"(spec 3.8): it is tokenizer.json of {pretrained_llm} (set tokenizer=<file, dir or repo id>, or copy it "
        "beside model.safetensors).")


def load_weights(ckpt_dir: str | Path, cfg: ModelConfig, device: str | torch.device = "cpu",
                 tokenizer: str | Path | None = None):
    """(VoiceChat, Tokenizer, RNNTVocab | None, ModelConfig) for `cfg`, the checkpoint's own configuration
    (config_from_official, possibly with generation settings changed): dimensions are checked against
    the tensor shapes before anything is allocated; then a strict load."""
    ckpt_dir = Path(ckpt_dir)
    check_dimensions(cfg, tensor_shapes(ckpt_dir))
    tok = Tokenizer.from_file(find_tokenizer(ckpt_dir, tokenizer, cfg.pretrained_llm))
    cfg = _token_ids(cfg, tok)
    rnnt_json = ckpt_dir / "rnnt_tokenizer" / "vocab.json"
    rnnt_vocab = RNNTVocab.from_file(rnnt_json) if cfg.rnnt.present and rnnt_json.is_file() else None

    model = build_empty_model(cfg, device)
    # tokenizer tables first, then the checkpoint: its stored continuation/BOS-EOS flag buffers are what
    # the model was trained with and win over the ones recomputed from the tokenizer
    model.set_vocab(tok)
    load_state(model, ckpt_dir)
    return model, tok, rnnt_vocab, cfg


def read_config(ckpt_dir: str | Path, base: ModelConfig) -> ModelConfig:
    """The checkpoint's configuration: its config.json over `base` (config_from_official), with the LLM's
    HF config found through `pretrained_llm` (a local directory or the hub's cache)."""
    from nemo_duplex.checkpoint.hub import find_file

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "config.json").is_file():
        raise CheckpointError(f"no config.json in {ckpt_dir}")
    official = _read_json(ckpt_dir / "config.json")
    pretrained_llm = official.get("model", {}).get("stt", {}).get("model", {}).get("pretrained_llm",
                                                                                   base.pretrained_llm)
    return config_from_official(official, ckpt_dir, base, find_file("config.json", ckpt_dir, pretrained_llm))


def load_model(ckpt_dir: str | Path, base: ModelConfig, device: str | torch.device = "cpu",
               tokenizer_path: str | Path | None = None):
    """(VoiceChat, Tokenizer, RNNTVocab | None, ModelConfig) from a checkpoint directory. The config
    comes from its config.json (fields it lacks from `base`)."""
    return load_weights(ckpt_dir, read_config(ckpt_dir, base), device, tokenizer_path)


def write_checkpoint(model: nn.Module, cfg: ModelConfig, out_dir: str | Path, tokenizer: Tokenizer,
                     rnnt_vocab: RNNTVocab | None, shard_bytes: int | None = None, random_weights: bool = False) -> Path:
    """Write the official layout: model.safetensors (or shards + index when shard_bytes is set),
    config.json with `pretrained_llm: llm` and llm/config.json (spec 12.4), tokenizer.json (+
    tokenizer_config.json), rnnt_tokenizer/{vocab.json, tokenizer_config.json}. `random_weights` marks
    config.json (`"random_weights": true`, which the gate reads: eval/gate.py resolve_checkpoint_kind)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = model.state_dict()
    if shard_bytes is None:
        write_safetensors(out / SINGLE_FILE, tensors, {"format": "pt"})
    else:
        groups = _shards(tensors, shard_bytes)
        weight_map = {}
        for n, keys in enumerate(groups, start=1):
            name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
            write_safetensors(out / name, {k: tensors[k] for k in keys}, {"format": "pt"})
            weight_map.update({k: name for k in keys})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=1))

    _write_side_files(cfg, out, tokenizer, rnnt_vocab, random_weights)
    return out


def _write_side_files(cfg: ModelConfig, out: Path, tokenizer: Tokenizer, rnnt_vocab: RNNTVocab | None,
                      random_weights: bool = False) -> None:
    """Everything of the official layout but the weights."""
    cfg = replace(cfg, pretrained_llm=LOCAL_LLM_DIR)
    official = official_config(cfg)
    if random_weights:
        official["random_weights"] = True
    (out / "config.json").write_text(json.dumps(official, indent=2))
    (out / LOCAL_LLM_DIR).mkdir(exist_ok=True)
    (out / LOCAL_LLM_DIR / "config.json").write_text(json.dumps(hf_llm_config(cfg.llm, cfg.tokens), indent=2))
    tokenizer.save(out / "tokenizer.json")
    t = cfg.tokens
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": t.bos_token, "eos_token": t.eos_token,
         "pad_token": t.pad_token, "unk_token": "<unk>"}, indent=1))
    if rnnt_vocab is not None:
        (out / "rnnt_tokenizer").mkdir(exist_ok=True)
        rnnt_vocab.save(out / "rnnt_tokenizer" / "vocab.json")
        (out / "rnnt_tokenizer" / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_type": "sentencepiece", "vocab_size": rnnt_vocab.vocab_size}, indent=1))


def make_tokenizer_for(cfg: ModelConfig) -> Tokenizer:
    """A deterministic byte-level tokenizer with cfg.llm.vocab_size ids and cfg.talker.cas.num_chars
    single-character tokens (the tiny one at the tiny sizes; synthetic merges fill bigger vocabs)."""
    return Tokenizer(make_byte_level_tokenizer(cfg.llm.vocab_size, cfg.talker.cas.num_chars))


def _randomise(model, cfg: ModelConfig, tokenizer: Tokenizer, seed: int, device="cpu") -> None:
    """Seeded weights (init_weights fills every parameter), the tokenizer tables, and the silence codes
    computed by the codec itself (spec 5.5: the most frequent code frame of encoded silence). The draws
    happen on `device`'s generator: a CUDA model is filled on the GPU in seconds, with other (still
    seeded) values than a CPU build."""
    model.init_weights(torch.Generator(device=torch.device(device)).manual_seed(seed))
    model.set_vocab(tokenizer)
    silence = model.tts_model.audio_codec.silence_codes()
    model.tts_model.codec_silence_tokens.copy_(silence.reshape(-1))


@torch.no_grad()
def random_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int = 0):
    """(VoiceChat, Tokenizer, RNNTVocab | None) with seeded random weights built straight on `device`
    (for `weights=random` benchmarks; nothing is written). On the CPU, the same weights as
    make_random_checkpoint."""
    tokenizer = make_tokenizer_for(cfg)
    cfg = _token_ids(cfg, tokenizer)
    model = build_empty_model(cfg, device)
    _randomise(model, cfg, tokenizer, seed, device)
    rnnt_vocab = make_tiny_rnnt_vocab(cfg.rnnt.vocab_size) if cfg.rnnt.present else None
    return model, tokenizer, rnnt_vocab


@torch.no_grad()
def make_random_checkpoint_in_place(cfg: ModelConfig, out_dir: str | Path, seed: int = 0) -> Path:
    """The same checkpoint as make_random_checkpoint (same weights, single file), written without holding
    the model in RAM: the parameters are views into the memory-mapped `model.safetensors` itself, at their
    header offsets, and init_weights fills them in place, so the page cache carries the 44 GB of the
    full-size model to disk (a machine with less memory than the checkpoint can write it). Buffers (small)
    are written after the parameters are filled. Layout: 8-byte-aligned buffers first, then parameters."""
    from nemo_duplex.models.model import VoiceChat

    tokenizer = make_tokenizer_for(cfg)
    cfg = _token_ids(cfg, tokenizer)
    with _parameters_on_meta():
        model = VoiceChat(cfg)  # fp32 parameters on meta, real buffers (spec 6.3: fp32 storage)
    params = dict(model.named_parameters())
    buffers = {k: v for k, v in model.state_dict().items() if k not in params}
    order = sorted(buffers, key=lambda k: (buffers[k].element_size() % 8 != 0, k)) + sorted(params)
    header, offset = {}, 0
    for name in order:
        t = params[name] if name in params else buffers[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / SINGLE_FILE
    data_start = 8 + len(blob)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        f.truncate(data_start + offset)
    file = torch.from_file(str(path), shared=True, size=data_start + offset, dtype=torch.uint8)

    def view(name: str, like: torch.Tensor) -> torch.Tensor:
        start, end = header[name]["data_offsets"]
        return file[data_start + start: data_start + end].view(like.dtype).view(like.shape)

    for module in model.modules():
        for leaf, p in list(module._parameters.items()):
            if p is not None and p.device.type == "meta":
                qualified = next(k for k, v in params.items() if v is p)
                setattr(module, leaf, nn.Parameter(view(qualified, p), requires_grad=False))
    _randomise(model, cfg, tokenizer, seed)
    for name, t in model.state_dict().items():
        if name in buffers:
            view(name, t).copy_(t)
    del file  # unmaps; the shared mapping has written every page to the file
    rnnt_vocab = make_tiny_rnnt_vocab(cfg.rnnt.vocab_size) if cfg.rnnt.present else None
    _write_side_files(cfg, out, tokenizer, rnnt_vocab, random_weights=True)
    return out


@torch.no_grad()
def make_random_checkpoint(cfg: ModelConfig, out_dir: str | Path, seed: int = 0,
                           shard_bytes: int | None = None) -> Path:
    """Seeded random VoiceChat(cfg) written in the official layout, with a generated tokenizer,
    RNN-T vocabulary and the codec's own silence codes (spec 5.5)."""
    from nemo_duplex.models.model import VoiceChat

    tokenizer = make_tokenizer_for(cfg)
    cfg = _token_ids(cfg, tokenizer)
    model = VoiceChat(cfg)  # on the CPU, fp32: the checkpoint stores fp32 (spec 6.3)
    _randomise(model, cfg, tokenizer, seed)
    rnnt_vocab = make_tiny_rnnt_vocab(cfg.rnnt.vocab_size) if cfg.rnnt.present else None
    return write_checkpoint(model, cfg, out_dir, tokenizer, rnnt_vocab, shard_bytes, random_weights=True)
