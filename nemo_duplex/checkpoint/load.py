"""Strict loading of a checkpoint in the official layout (spec 6) into VoiceChat.

Tensors are read one at a time (`safe_open`) straight into parameters that were created empty on the
target device, so loading never holds a second copy of the 44 GB model. Every dimension of the
configuration is checked against the tensor shapes before anything is allocated (spec 12.4).
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from nemo_duplex.checkpoint.files import CheckpointError, checkpoint_files, read_header, tensor_shapes
from nemo_duplex.checkpoint.official import read_config
from nemo_duplex.models.config import ModelConfig
from nemo_duplex.models.tokenizer import RNNTVocab, Tokenizer


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
def parameters_on_meta():
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


def materialise(model: nn.Module, device: torch.device) -> None:
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

    with parameters_on_meta():
        model = VoiceChat(cfg)
    if hasattr(model, "cast_for_inference"):
        # free on meta: parameters are created directly in their final dtype (fp8 projections are quantised
        # by the cast after the weights are in: runtime.load)
        model.cast_for_inference(quantize=False)
    materialise(model, torch.device(device))
    return model.eval()


def with_token_ids(cfg: ModelConfig, tokenizer: Tokenizer) -> ModelConfig:
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
    cfg = with_token_ids(cfg, tok)
    rnnt_json = ckpt_dir / "rnnt_tokenizer" / "vocab.json"
    rnnt_vocab = RNNTVocab.from_file(rnnt_json) if cfg.rnnt.present and rnnt_json.is_file() else None

    model = build_empty_model(cfg, device)
    # tokenizer tables first, then the checkpoint: its stored continuation/BOS-EOS flag buffers are what
    # the model was trained with and win over the ones recomputed from the tokenizer
    model.set_vocab(tok)
    load_state(model, ckpt_dir)
    return model, tok, rnnt_vocab, cfg


def load_model(ckpt_dir: str | Path, base: ModelConfig, device: str | torch.device = "cpu",
               tokenizer_path: str | Path | None = None):
    """(VoiceChat, Tokenizer, RNNTVocab | None, ModelConfig) from a checkpoint directory. The config
    comes from its config.json (fields it lacks from `base`)."""
    return load_weights(ckpt_dir, read_config(ckpt_dir, base), device, tokenizer_path)

