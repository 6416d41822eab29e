"""Checkpoints with seeded random weights in the official layout: the embedded tiny model, the tests'
checkpoints, `model.weights=random` for speed measurements (scripts/make_checkpoint.py writes them)."""
from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn

from nemo_duplex.checkpoint.files import INDEX_FILE, SINGLE_FILE, ST_DTYPES, shard_groups, write_safetensors
from nemo_duplex.checkpoint.load import build_empty_model, parameters_on_meta, with_token_ids
from nemo_duplex.checkpoint.official import LOCAL_LLM_DIR, hf_llm_config, official_config
from nemo_duplex.models.config import ModelConfig
from nemo_duplex.models.tokenizer import RNNTVocab, Tokenizer, make_byte_level_tokenizer, make_tiny_rnnt_vocab


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
        groups = shard_groups(tensors, shard_bytes)
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
    cfg = with_token_ids(cfg, tokenizer)
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
    cfg = with_token_ids(cfg, tokenizer)
    with parameters_on_meta():
        model = VoiceChat(cfg)  # fp32 parameters on meta, real buffers (spec 6.3: fp32 storage)
    params = dict(model.named_parameters())
    buffers = {k: v for k, v in model.state_dict().items() if k not in params}
    order = sorted(buffers, key=lambda k: (buffers[k].element_size() % 8 != 0, k)) + sorted(params)
    header, offset = {}, 0
    for name in order:
        t = params[name] if name in params else buffers[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
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
    cfg = with_token_ids(cfg, tokenizer)
    model = VoiceChat(cfg)  # on the CPU, fp32: the checkpoint stores fp32 (spec 6.3)
    _randomise(model, cfg, tokenizer, seed)
    rnnt_vocab = make_tiny_rnnt_vocab(cfg.rnnt.vocab_size) if cfg.rnnt.present else None
    return write_checkpoint(model, cfg, out_dir, tokenizer, rnnt_vocab, shard_bytes, random_weights=True)

