"""Checkpoint layout: config.json <-> ModelConfig, the strict loader, sharding, dimension checks, and
the random-checkpoint round trip through VoiceChat. One file past 500 lines on purpose: every key and
dimension of the official layout, checked in one place."""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from nemo_duplex.checkpoint.files import CheckpointError, read_header, tensor_shapes, write_safetensors
from nemo_duplex.checkpoint.load import check_dimensions, expected_shapes, load_state, materialise, parameters_on_meta
from nemo_duplex.checkpoint.official import config_from_official, hf_llm_config, llm_config_from_hf, official_config
from nemo_duplex.checkpoint.random_weights import write_checkpoint
from nemo_duplex.models.config import DtypeConfig, LLMConfig, ModelConfig, TokenConfig, tiny_config
from nemo_duplex.models.tokenizer import Tokenizer, make_tiny_tokenizer

# ---------------------------------------------------------------------------------------------
# A small stand-in module: every kind of tensor the real model has
# ---------------------------------------------------------------------------------------------

class Toy(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(11, width)
        self.proj = nn.Linear(width, 5)
        self.lstm = nn.LSTM(width, width, num_layers=2)
        self.scale = nn.Parameter(torch.ones(()))
        self.low = nn.Linear(width, 3, bias=False).to(torch.bfloat16)
        self.register_buffer("codes", torch.arange(7, dtype=torch.int64) * 3)
        self.register_buffer("table", torch.linspace(0, 1, 9), persistent=False)  # computed, not stored

    def randomise(self, seed: int) -> "Toy":
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            self.codes.copy_(torch.randint(0, 100, self.codes.shape, generator=g))
        return self


def _fp32_state(m: nn.Module) -> dict:
    return {k: v.float() if v.is_floating_point() else v for k, v in m.state_dict().items()}


def test_write_safetensors_reads_with_safetensors(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b.c": torch.arange(5), "s": torch.tensor(2.5),
               "h": torch.randn(2, 3).to(torch.bfloat16), "e": torch.zeros(0, 4)}
    write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for k, t in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)


def test_load_state_round_trip_and_dtype_cast(tmp_path):
    src = Toy().randomise(0)
    save_file(_fp32_state(src), str(tmp_path / "model.safetensors"))  # an fp32 file, like the release
    dst = Toy().randomise(1)
    load_state(dst, tmp_path)
    assert dst.low.weight.dtype == torch.bfloat16, "floats are cast to the parameter's dtype"
    assert dst.codes.dtype == torch.int64
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    x = torch.randn(4, 1, 8)
    assert torch.equal(dst.lstm(x)[0], src.lstm(x)[0]), "the LSTM uses the loaded weights"


def test_load_state_reports_every_problem_at_once(tmp_path):
    model = Toy()
    good = _fp32_state(model)

    def check(tensors, *needles):
        save_file(tensors, str(tmp_path / "model.safetensors"))
        with pytest.raises(CheckpointError) as e:
            load_state(Toy(), tmp_path)
        for n in needles:
            assert n in str(e.value), (n, str(e.value))
        return str(e.value)

    missing = dict(good)
    del missing["proj.bias"]
    check(missing, "1 missing", "proj.bias")
    extra = dict(good, **{"proj.extra": torch.zeros(2)})
    check(extra, "1 unexpected", "proj.extra")
    wrong = dict(good, **{"embed.weight": torch.zeros(12, 8)})
    check(wrong, "1 mis-shaped", "embed.weight: model expects [11, 8], checkpoint has [12, 8]")
    kind = dict(good, **{"codes": torch.zeros(7)})
    check(kind, "codes")

    everything = dict(good, **{"proj.extra": torch.zeros(2), "other.w": torch.zeros(1),
                               "embed.weight": torch.zeros(12, 8)})
    del everything["proj.bias"], everything["lstm.weight_hh_l1"]
    msg = check(everything, "2 missing", "2 unexpected", "1 mis-shaped", "proj.bias", "lstm.weight_hh_l1",
                "proj.extra", "other.w", "embed.weight")
    assert msg.count("\n") >= 5 + 3, "one error that lists every key"


def test_sharded_checkpoint_loads_the_same(tmp_path):
    src = Toy(width=16).randomise(3)
    tokenizer = Tokenizer(make_tiny_tokenizer())
    cfg = tiny_config()
    write_checkpoint(src, cfg, tmp_path / "single", tokenizer, None)
    write_checkpoint(src, cfg, tmp_path / "sharded", tokenizer, None, shard_bytes=1200)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 3 and set(index["weight_map"]) == set(src.state_dict())
    assert tensor_shapes(tmp_path / "single") == tensor_shapes(tmp_path / "sharded")
    a, b = Toy(width=16), Toy(width=16).randomise(9)
    load_state(a, tmp_path / "single")
    load_state(b, tmp_path / "sharded")
    for k, v in src.state_dict().items():
        assert torch.equal(a.state_dict()[k], v) and torch.equal(b.state_dict()[k], v), k
    # an index that names a key its shard does not hold is an error
    index["weight_map"]["ghost"] = sorted(shards)[0]
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="ghost"):
        load_state(Toy(width=16), tmp_path / "sharded")


def test_parameters_on_meta_keep_buffers_and_materialise(tmp_path):
    with parameters_on_meta():
        m = Toy()
    assert all(p.device.type == "meta" for p in m.parameters())
    assert torch.equal(m.table, torch.linspace(0, 1, 9)), "non-persistent buffers keep their computed values"
    assert nn.Module.register_parameter is not None and Toy().proj.weight.device.type == "cpu", "patch undone"
    materialise(m, torch.device("cpu"))
    assert all(p.device.type == "cpu" for p in m.parameters()) and m.low.weight.dtype == torch.bfloat16
    src = Toy().randomise(5)
    save_file(_fp32_state(src), str(tmp_path / "model.safetensors"))
    load_state(m, tmp_path)
    x = torch.randn(3, 2, 8)
    assert torch.equal(m.lstm(x)[0], src.lstm(x)[0])
    assert torch.equal(m.table, src.table)


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig
# ---------------------------------------------------------------------------------------------

def _other_base() -> ModelConfig:
    """A base config that differs from the tiny and full ones in everything config.json cannot carry."""
    return replace(ModelConfig(), name="base", weights="random",
                   frontend=replace(ModelConfig().frontend, variant="nemo3"),
                   dtype=DtypeConfig(llm="bf16", talker="bf16", encoder="bf16"),
                   tokens=replace(TokenConfig(), tool_call_start="<X>"))


def _with_uncarried(cfg: ModelConfig, base: ModelConfig) -> ModelConfig:
    """cfg with the fields config.json does not carry taken from base (num_chars: from the weights)."""
    t = replace(cfg.talker, num_iter=base.talker.num_iter, cas=replace(cfg.talker.cas, num_chars=base.talker.cas.num_chars))
    return replace(cfg, name=base.name, weights=base.weights, default_checkpoint=base.default_checkpoint, dtype=base.dtype,
                   frontend=replace(cfg.frontend, variant=base.frontend.variant),
                   tokens=replace(base.tokens, bos_token=cfg.tokens.bos_token, eos_token=cfg.tokens.eos_token,
                                  pad_token=cfg.tokens.pad_token), talker=t)


def _json_round_trip(d: dict) -> dict:
    return json.loads(json.dumps(d))


@pytest.mark.parametrize("which", ["tiny", "full"])
def test_config_round_trip(tmp_path, which):
    cfg = replace(tiny_config(), pretrained_llm="llm") if which == "tiny" else ModelConfig()
    cfg = replace(cfg, talker=replace(cfg.talker, guidance_scale=0.3, top_p=0.9, noise_scale=0.01, speaker="Zed"),
                  function_channel_weight=1.5)
    if which == "tiny":  # a local HF LLM config beside config.json (spec 12.4)
        (tmp_path / "llm").mkdir()
        (tmp_path / "llm" / "config.json").write_text(json.dumps(hf_llm_config(cfg.llm)))
    base = _other_base()
    official = _json_round_trip(official_config(cfg))
    got = config_from_official(official, tmp_path, base)
    assert got == _with_uncarried(cfg, base)
    # and the dict form is stable
    assert _json_round_trip(official_config(got)) == official


def test_config_top_k_and_rnnt_decoding(tmp_path):
    cfg = ModelConfig()
    cfg = replace(cfg, talker=replace(cfg.talker, top_k=1), rnnt=replace(cfg.rnnt, max_symbols_per_step=4))
    official = _json_round_trip(official_config(cfg))
    assert official["model"]["speech_generation"]["model"]["inference_top_p_or_k"] == 1
    got = config_from_official(official, tmp_path, ModelConfig())
    assert got.talker.top_k == 1 and got.rnnt.max_symbols_per_step == 4


def test_official_config_has_the_spec_fields():
    o = official_config(ModelConfig())
    stt = o["model"]["stt"]["model"]
    assert o["data"] == {"source_sample_rate": 16000, "target_sample_rate": 22050, "frame_length": 0.08}
    assert (stt["bos_token"], stt["eos_token"], stt["pad_token"]) == ("<s>", "</s>", "<SPECIAL_12>")
    assert (stt["duplex_user_channel_weight"], stt["duplex_text_channel_weight"],
            stt["duplex_function_channel_weight"]) == (1.0, 1.0, 2.0)
    enc = stt["perception"]["encoder"]
    assert enc["att_context_size"] == [70, 0] and enc["subsampling_conv_channels"] == 256 and enc["feat_in"] == 128
    assert stt["perception"]["preprocessor"]["normalize"] == "NA"
    assert stt["perception"]["preprocessor"]["window_size"] == 0.025
    gen = o["model"]["speech_generation"]["model"]
    assert (gen["inference_guidance_scale"], gen["inference_top_p_or_k"], gen["inference_noise_scale"]) == (
        0.2, 0.95, 0.001)
    assert gen["tts_config"]["backbone_config"]["layer_types"][5] == "full_attention"
    assert o["model"]["_rnnt_merge_info"]["joint_config"]["jointnet"]["encoder_hidden"] == 1024
    assert "hidden_size" not in json.dumps(stt), "the LLM dims are not in config.json (spec 12.4)"


def test_both_nemo_name_generations_and_missing_llm_dir(tmp_path):
    cfg = ModelConfig()
    old = _json_round_trip(official_config(cfg))
    new = _json_round_trip(old)
    stt = new["model"]["stt"]["model"]
    stt["llm_attr_name"], stt["embed_tokens_attr_name"] = stt.pop("base_model_name"), stt.pop("embed_tokens_name")
    stt["llm_attr_name"], stt["embed_tokens_attr_name"] = "model", "embed_tokens"
    a = config_from_official(old, tmp_path, cfg)
    b = config_from_official(new, tmp_path, cfg)
    assert a == b == cfg
    # pretrained_llm names a hub id with no local dir: the built-in Nano-9B-v2 dims, whatever base says
    small_base = tiny_config()
    assert config_from_official(old, tmp_path, small_base).llm == LLMConfig()


def test_absent_function_head_and_rnnt(tmp_path):
    o = _json_round_trip(official_config(ModelConfig()))
    o["model"]["stt"]["model"]["use_function_head"] = False
    del o["model"]["_rnnt_merge_info"]
    got = config_from_official(o, tmp_path, ModelConfig())
    assert got.llm.use_function_head is False and got.rnnt.present is False
    del o["model"]["stt"]["model"]["use_function_head"]  # nemo-toolkit 3.0.0: no such key, no head
    assert config_from_official(o, tmp_path, ModelConfig()).llm.use_function_head is False


def test_llm_config_from_hf_both_spellings():
    llm = tiny_config().llm
    d = hf_llm_config(llm)
    assert d["num_hidden_layers"] == 10 and d["model_type"] == "nemotron_h"
    assert llm_config_from_hf(d) == llm
    letters = {"M": "mamba", "*": "attention", "-": "mlp"}
    d2 = dict(d, layers_block_type=[letters[c] for c in llm.hybrid_override_pattern])
    del d2["hybrid_override_pattern"]
    assert llm_config_from_hf(d2) == llm
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        llm_config_from_hf(dict(d, num_hidden_layers=9))


def test_transformers_reads_our_llm_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    d = hf_llm_config(tiny_config().llm)
    hf = transformers.NemotronHConfig(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})
    assert hf.hybrid_override_pattern == tiny_config().llm.hybrid_override_pattern
    assert (hf.mamba_num_heads, hf.mamba_head_dim, hf.n_groups, hf.head_dim) == (8, 12, 2, 24)


# ---------------------------------------------------------------------------------------------
# Dimension checks
# ---------------------------------------------------------------------------------------------

def test_expected_shapes_match_spec_table_at_full_size():
    shapes = {k: s for _, k, s in expected_shapes(ModelConfig())}
    spec = {  # spec 6.3
        "stt_model.embed_tokens.weight": [131072, 4480],
        "stt_model.function_head.weight": [131072, 4480],
        "stt_model.llm.layers.0.mixer.in_proj.weight": [22656, 4480],
        "stt_model.llm.layers.0.mixer.conv1d.weight": [12288, 1, 4],
        "stt_model.llm.layers.0.mixer.A_log": [128],
        "stt_model.llm.layers.0.mixer.norm.weight": [10240],
        "stt_model.llm.layers.0.mixer.out_proj.weight": [4480, 10240],
        "stt_model.llm.layers.14.mixer.q_proj.weight": [5120, 4480],
        "stt_model.llm.layers.14.mixer.k_proj.weight": [1024, 4480],
        "stt_model.llm.layers.1.mixer.up_proj.weight": [15680, 4480],
        "stt_model.perception.proj.weight": [4480, 1024],
        "tts_model.tts_model.backbone.layers.27.self_attn.q_proj.weight": [1152, 1152],
        "tts_model.tts_model.backbone.layers.0.self_attn.q_norm.weight": [72],
        "tts_model.tts_model.embed_subword.embed_tokens.weight": [257, 1152],
        "tts_model.tts_model.rvq_embs": [31, 1024, 512],
        "tts_model.tts_model.mog_head.proj_mus.weight": [65536, 1152],
        "tts_model.tts_model.mog_head.low_mat": [1024, 512, 64],
        "tts_model.tts_model.mog_head.mlp_stack.3.weight": [1152],
        "tts_model.audio_prompt_latents.Aria": [1, 37, 1152],
        "tts_model.codec_silence_tokens": [31],
        "tts_model.audio_codec.prvq.mus_list.0": [1024, 512],
    }
    for k, s in spec.items():
        assert shapes[k] == s, k
    assert "stt_model.llm.layers.56.norm.weight" not in shapes


def test_check_dimensions_names_the_field():
    cfg = ModelConfig()
    good = {k: s for _, k, s in expected_shapes(cfg)}
    check_dimensions(cfg, good)
    bad = dict(good)
    bad["stt_model.llm.layers.0.mixer.in_proj.weight"] = [22656 - 128 + 64, 4480]
    del bad["stt_model.llm.layers.14.mixer.q_proj.weight"]
    bad["stt_model.llm.layers.56.norm.weight"] = [4480]
    with pytest.raises(CheckpointError) as e:
        check_dimensions(cfg, bad)
    msg = str(e.value)
    assert "layers.0.mixer.in_proj.weight" in msg and "mamba_num_heads" in msg
    assert "layers.14.mixer.q_proj.weight" in msg and "not in the checkpoint" in msg
    assert "llm layers" in msg and "57 of them" in msg


# ---------------------------------------------------------------------------------------------
# The real model (nemo_duplex.models.model.VoiceChat)
# ---------------------------------------------------------------------------------------------

def test_voicechat_keys_match_expected_shapes_at_full_size():
    from nemo_duplex.models.model import VoiceChat
    cfg = ModelConfig()
    with torch.device("meta"):
        model = VoiceChat(cfg)
    sd = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert all(k.startswith(("stt_model.", "tts_model.")) for k in sd)
    for what, k, s in expected_shapes(cfg):
        assert sd.get(k) == s, (k, what)
    check_dimensions(cfg, sd)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from nemo_duplex.checkpoint.random_weights import make_random_checkpoint
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_random_checkpoint(tiny_config(), out, seed=0)
    return out


def test_random_checkpoint_layout(tiny_ckpt):
    for f in ["config.json", "model.safetensors", "llm/config.json", "tokenizer.json", "tokenizer_config.json",
              "rnnt_tokenizer/vocab.json", "rnnt_tokenizer/tokenizer_config.json"]:
        assert (tiny_ckpt / f).is_file(), f
    header = read_header(tiny_ckpt / "model.safetensors")
    assert {v["dtype"] for v in header.values()} <= {"F32", "I64"}
    assert header["tts_model._control_codes"]["dtype"] == "I64"
    official = json.loads((tiny_ckpt / "config.json").read_text())
    assert official["model"]["stt"]["model"]["pretrained_llm"] == "llm"


def test_random_checkpoint_round_trip(tiny_ckpt, tmp_path):
    from nemo_duplex.checkpoint.load import load_model
    from nemo_duplex.checkpoint.random_weights import make_random_checkpoint
    from nemo_duplex.models.model import VoiceChat
    cfg = tiny_config()
    model, tokenizer, rnnt_vocab, got = load_model(tiny_ckpt, base=cfg, device="cpu")
    assert isinstance(model, VoiceChat)
    # dims equal; pretrained_llm now names the local dir
    assert replace(got, pretrained_llm=cfg.pretrained_llm) == cfg
    assert tokenizer.vocab_size == cfg.llm.vocab_size and rnnt_vocab.vocab_size == cfg.rnnt.vocab_size
    with safe_open(str(tiny_ckpt / "model.safetensors"), framework="pt") as f:
        sd = model.state_dict()
        assert set(sd) == set(f.keys())
        for k in f.keys():
            assert torch.equal(sd[k], f.get_tensor(k)), k
    # buffers that are not in the checkpoint (computed in __init__ / set_vocab) survive the empty build
    fresh = VoiceChat(got)
    fresh.set_vocab(tokenizer)
    computed = [n for n, _ in fresh.named_buffers() if n not in sd]
    for name in computed:
        assert torch.equal(dict(model.named_buffers())[name], dict(fresh.named_buffers())[name]), name
    assert computed, "the tiny model has computed buffers (e.g. relative positions), so this checks something"
    silence = model.tts_model.codec_silence_tokens
    assert silence.dtype == torch.int64 and int(silence.min()) >= 0 and int(silence.max()) < cfg.codec.codebook_size
    # same seed, same checkpoint
    make_random_checkpoint(cfg, tmp_path / "again", seed=0)
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (tiny_ckpt / "model.safetensors").read_bytes()


def test_load_model_errors(tiny_ckpt, tmp_path):
    import shutil

    from nemo_duplex.checkpoint.load import load_model
    cfg = tiny_config()
    d = tmp_path / "c"
    shutil.copytree(tiny_ckpt, d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError) as e:
        load_model(d, cfg, "cpu", tokenizer_path=tmp_path / "nowhere.json")
    assert "tokenizer=" in str(e.value) and "nowhere.json" in str(e.value)   # the one that was asked for
    with pytest.raises(CheckpointError) as e:   # none given: beside the checkpoint, then its pretrained_llm's
        load_model(d, cfg, "cpu")
    assert str(d / "tokenizer.json") in str(e.value) and str(d / "llm" / "tokenizer.json") in str(e.value)
    model, *_ = load_model(d, cfg, "cpu", tokenizer_path=tiny_ckpt / "tokenizer.json")
    # an LLM config that disagrees with the tensors: a dimension error naming the field
    llm = json.loads((d / "llm" / "config.json").read_text())
    (d / "llm" / "config.json").write_text(json.dumps(dict(llm, intermediate_size=200)))
    with pytest.raises(CheckpointError, match="intermediate_size"):
        load_model(d, cfg, "cpu", tokenizer_path=tiny_ckpt / "tokenizer.json")


def test_random_model_equals_random_checkpoint(tiny_ckpt):
    # random_model builds on empty parameters: equal weights prove init_weights fills every tensor
    from nemo_duplex.checkpoint.random_weights import random_model
    model, tokenizer, rnnt_vocab = random_model(tiny_config(), "cpu", seed=0)
    with safe_open(str(tiny_ckpt / "model.safetensors"), framework="pt") as f:
        sd = model.state_dict()
        assert set(sd) == set(f.keys())
        for k in f.keys():
            assert torch.equal(sd[k], f.get_tensor(k)), k
    assert tokenizer.token_strings() == Tokenizer.from_file(tiny_ckpt / "tokenizer.json").token_strings()


def test_make_checkpoint_script(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "tiny"
    r = subprocess.run([sys.executable, str(repo / "scripts" / "make_checkpoint.py"), "model=nemotron_duplex_tiny",
                        f"out={out}", "seed=0", f"hydra.run.dir={tmp_path / 'hydra'}"],
                       cwd=repo, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    got = config_from_official(json.loads((out / "config.json").read_text()), out, tiny_config())
    assert replace(got, pretrained_llm=tiny_config().pretrained_llm) == tiny_config()


def test_checkpoint_without_function_head_and_rnnt(tmp_path):
    # nemo-toolkit 3.0.0 generation (spec 12.1): no function head, no RNN-T modules
    from nemo_duplex.checkpoint.load import load_model
    from nemo_duplex.checkpoint.random_weights import make_random_checkpoint
    cfg = tiny_config()
    cfg = replace(cfg, llm=replace(cfg.llm, use_function_head=False), rnnt=replace(cfg.rnnt, present=False))
    make_random_checkpoint(cfg, tmp_path / "c", seed=1)
    assert not (tmp_path / "c" / "rnnt_tokenizer").exists()
    official = json.loads((tmp_path / "c" / "config.json").read_text())
    assert "_rnnt_merge_info" not in official["model"]
    keys = set(read_header(tmp_path / "c" / "model.safetensors"))
    assert "stt_model.function_head.weight" not in keys and not any("rnnt" in k for k in keys)
    model, _, rnnt_vocab, got = load_model(tmp_path / "c", tiny_config(), "cpu")
    assert got.llm.use_function_head is False and got.rnnt.present is False and rnnt_vocab is None
    # loading it into a model that expects the heads lists every missing key
    from nemo_duplex.models.model import VoiceChat
    with pytest.raises(CheckpointError) as e:
        load_state(VoiceChat(tiny_config()), tmp_path / "c")
    assert "stt_model.function_head.weight" in str(e.value) and "stt_model.rnnt_joint.enc.weight" in str(e.value)


def test_loader_keeps_the_checkpoints_token_flags(tiny_checkpoint, tmp_path):
    """The continuation / BOS-EOS flag buffers come from the checkpoint (what the model was trained
    with), not from recomputing them off the tokenizer."""
    import shutil

    from safetensors.torch import load_file, save_file

    from nemo_duplex.checkpoint.load import load_model
    from nemo_duplex.models.config import tiny_config

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    key = "tts_model.tts_model.embed_subword.subword_flag_emb.is_continuation"
    tensors[key][40] = 1 - tensors[key][40]
    save_file(tensors, str(ckpt / "model.safetensors"))
    model, *_ = load_model(ckpt, tiny_config(), torch.device("cpu"))
    assert torch.equal(model.state_dict()[key], tensors[key])


def test_in_place_writer_gives_the_same_checkpoint(tiny_checkpoint, tmp_path):
    """The low-memory writer (parameters live in the memory-mapped output file) writes the same tensors
    as the in-RAM one, and the result loads through the strict loader."""
    from safetensors.torch import load_file

    from nemo_duplex.checkpoint.load import load_model
    from nemo_duplex.checkpoint.random_weights import make_random_checkpoint_in_place
    from nemo_duplex.models.config import tiny_config

    out = make_random_checkpoint_in_place(tiny_config(), tmp_path / "inplace", seed=0)
    a = load_file(str(out / "model.safetensors"))
    b = load_file(str(tiny_checkpoint / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    model, *_ = load_model(out, tiny_config(), torch.device("cpu"))
    assert torch.equal(model.state_dict()["stt_model.lm_head.weight"], b["stt_model.lm_head.weight"])


def test_load_state_re_splits_the_codecs_gemm_weights(tiny_checkpoint, monkeypatch):
    """The codec's pre-split decoder GEMM weights (RVQCodec.presplit_weights, which cast_for_inference calls;
    built where decode_step's GEMMs run tf32x3w: here the CPU under TRITON_INTERPRET=1) follow
    checkpoint.load_state: re-split in place from the loaded weights, never the random ones left."""
    from nemo_duplex.checkpoint.random_weights import random_model
    from nemo_duplex.models.codec import gemm_weight
    from nemo_duplex.models.config import tiny_config
    from ops.fp32_linear import split_tf32_reference

    cfg = tiny_config()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(replace(cfg, codec=replace(cfg.codec, gemm="tf32x3w")), device, seed=3)[0]
    model.cast_for_inference()
    if device == "cpu":   # the interpreter only now: the talker's tables through it take half a minute
        assert all(getattr(holder, name).numel() == 0 for holder, name, _ in model.codec.decoder.step_gemms())
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        model.codec.presplit_weights()
    gemms = model.codec.decoder.step_gemms()
    before = [getattr(holder, name).clone() for holder, name, _ in gemms]
    pointers = [getattr(holder, name).data_ptr() for holder, name, _ in gemms]
    load_state(model, tiny_checkpoint)
    for (holder, name, layer), old, pointer in zip(gemms, before, pointers):
        table = getattr(holder, name)
        assert table.data_ptr() == pointer and not torch.equal(table, old), name
        assert torch.equal(table, torch.stack(split_tf32_reference(gemm_weight(layer)))), name


def test_load_state_drops_tables_derived_from_the_old_weights(tiny_checkpoint):
    """checkpoint.load_state overwrites the weights in place and then calls every module's
    weights_loaded: the talker's text table, built from the random weights, is dropped, and the next
    cast_for_inference builds it from the loaded ones."""
    from nemo_duplex.checkpoint.random_weights import random_model
    from nemo_duplex.models.config import tiny_config

    model = random_model(tiny_config(), seed=3)[0].cast_for_inference()
    assert model.talker.text_table.numel() > 0
    load_state(model, tiny_checkpoint)
    assert model.talker.text_table.numel() == 0
    model.cast_for_inference()
    ids = torch.arange(0, model.talker.vocab_size, 3)
    with torch.no_grad():
        torch.testing.assert_close(model.talker.text_condition(ids), model.talker.embed_subword(ids),
                                   atol=1e-6, rtol=1e-6)


def test_embedded_checkpoint_appears_whole_even_to_a_concurrent_reader(tmp_path, monkeypatch):
    """runtime.embedded_checkpoint is written into a temporary sibling and renamed into place: a process
    that looks while another writes (a client starting beside its server, two test workers) sees either no
    checkpoint or a whole one, never config.json without its weights; two writers starting together both get
    the whole checkpoint, and no staging folder is left behind. The writer here is slowed down between its
    files (config.json first), so writing in place would be seen half-done."""
    import threading
    import time

    from nemo_duplex import runtime
    from nemo_duplex.checkpoint import random_weights as checkpoint_module
    from nemo_duplex.checkpoint.load import load_model
    from nemo_duplex.models.config import tiny_config

    real_writer = checkpoint_module.make_random_checkpoint

    def slow_writer(cfg, out, seed=0):
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")   # what a reader checks for first
        time.sleep(0.5)
        real_writer(cfg, out, seed)
        return out

    monkeypatch.setattr(checkpoint_module, "make_random_checkpoint", slow_writer)
    monkeypatch.setattr(runtime, "DEFAULT_CHECKPOINTS", tmp_path / "checkpoints")
    target = tmp_path / "checkpoints" / "nemotron_duplex_tiny-seed3"
    start, paths, errors, half_seen = threading.Barrier(3), [], [], []
    done = threading.Event()

    def write():
        try:
            start.wait()
            paths.append(runtime.embedded_checkpoint(tiny_config(), seed=3))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def read():
        start.wait()
        while not done.is_set():
            if (target / "config.json").exists() and not (target / "model.safetensors").exists():
                half_seen.append(True)
            time.sleep(0.001)

    writers = [threading.Thread(target=write) for _ in range(2)]
    reader = threading.Thread(target=read)
    for t in [*writers, reader]:
        t.start()
    for t in writers:
        t.join()
    done.set()
    reader.join()
    assert not errors, errors
    assert not half_seen, "config.json was visible before the weights"
    assert paths[0] == paths[1] == target
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
    assert target.stat().st_mode & 0o777 == 0o755   # not the staging folder's 0700
    monkeypatch.setattr(checkpoint_module, "make_random_checkpoint", real_writer)
    model, *_ = load_model(target, tiny_config(), torch.device("cpu"))
    assert model is not None


def test_embedded_checkpoint_replaces_a_partial_one(tmp_path, monkeypatch):
    """A folder without config.json (a writer that died midway) is rewritten, not trusted."""
    from nemo_duplex import runtime
    from nemo_duplex.models.config import tiny_config

    monkeypatch.setattr(runtime, "DEFAULT_CHECKPOINTS", tmp_path)
    partial = tmp_path / "nemotron_duplex_tiny-seed0"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"truncated")
    out = runtime.embedded_checkpoint(tiny_config())
    assert out == partial and (out / "config.json").exists()
    assert (out / "model.safetensors").stat().st_size > 1000
