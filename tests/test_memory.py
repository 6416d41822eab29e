"""Memory planning (nemo_duplex/serving/memory.py): the per-call formulas against real pool allocations (tiny
model on the CPU, full size on the meta device), the weights against a real model, and the refusals."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

from nemo_duplex.models.config import ModelConfig, tiny_config
from nemo_duplex.models.model import VoiceChat
from nemo_duplex.serving.memory import (
    GiB,
    MemoryPlanError,
    bytes_per_call,
    codec_presplit_bytes,
    derived_table_bytes,
    frames_per_call,
    inference_config,
    max_call_s_that_fits,
    max_calls_that_fit,
    plan,
    weight_bytes,
)
from nemo_duplex.serving.state import allocate_call_state

REPO = Path(__file__).resolve().parent.parent


def tensor_bytes(obj) -> int:
    """Every tensor under a state object, lists included."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(x) for x in obj)
    return sum(tensor_bytes(getattr(obj, f.name)) for f in fields(obj))


def measured_per_slot(st) -> dict[str, int]:
    rows = st.max_calls + 1
    per = {name: tensor_bytes(getattr(st, name)) for name in ("encoder", "rnnt", "llm", "talker", "codec")}
    # every other tensor field of CallState (so a field added there cannot be left out of the plan)
    per["scalars"] = sum(tensor_bytes(getattr(st, f.name)) for f in fields(st)
                         if f.name not in per and isinstance(getattr(st, f.name), torch.Tensor))
    for name, total in per.items():
        assert total % rows == 0, f"{name}: {total} bytes is not a whole number of slot rows"
    return {k: v // rows for k, v in per.items()}


@pytest.mark.parametrize("compute", ["fp32", "bf16", "capacity"])
@pytest.mark.parametrize("max_call_s,prompt", [(1.0, 0), (2.5, 16)])
def test_per_call_bytes_match_the_allocation_tiny(compute, max_call_s, prompt):
    cfg = inference_config(tiny_config(), "bf16" if compute == "capacity" else compute)
    if compute == "capacity":   # conf/model/dtype/capacity.yaml: the talker's KV in float8, the SSM state in bf16
        cfg = replace(cfg, dtype=replace(cfg.dtype, talker_kv="fp8", mamba_ssm_state="bf16"))
    model = VoiceChat(cfg).cast_for_inference()
    st = allocate_call_state(model, 3, frames_per_call(cfg, max_call_s), torch.device("cpu"), prompt)
    planned = bytes_per_call(cfg, max_call_s, prompt)
    measured = measured_per_slot(st)
    assert planned.by_pool() == measured
    # CallState.nbytes_per_slot agrees on every pool, the codec's list-valued ConvNeXt histories included
    assert st.nbytes_per_slot() == measured


# scripts/bench_step.py at full size in bf16 on the H200 (its JSON's rows[0]): the parameters it counted on the
# loaded model, and the Mamba SSM state a call reads and writes per step
BENCH_STEP_H200 = {"weight_bytes": 22_590_039_552, "mamba_ssm_read_written": 283_115_520}


def test_per_call_bytes_match_the_allocation_full_size_on_meta():
    cfg = inference_config(ModelConfig(), "bf16")
    with torch.device("meta"):
        model = VoiceChat(cfg).cast_for_inference()
    st = allocate_call_state(model, 2, frames_per_call(cfg, 160.0), torch.device("meta"), 512)
    planned = bytes_per_call(cfg, 160.0, 512)
    assert planned.by_pool() == measured_per_slot(st)
    # one component against what scripts/bench_step.py measured on the H200 (its JSON's
    # state_bytes_per_call: read + write = 2x one state)
    assert 2 * planned.mamba_ssm == BENCH_STEP_H200["mamba_ssm_read_written"]


def test_weight_bytes_match_a_real_model(tiny):
    model = tiny[0]
    model.perception.prepare_stream()   # as when serving (built with the encoder's stream state otherwise)
    model.codec.prvq.stacked()          # the stacked codebooks (built with the codec's stream state otherwise)
    real = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    longest_token = model.talker.embed_subword.char_ids.shape[1]   # set from the tokenizer (spec 4.2.2)
    # on the CPU (no interpreter here) gemm "auto" is IEEE: the codec keeps no pre-split weights
    assert weight_bytes(tiny_config(), longest_token, device="cpu") == real
    assert weight_bytes(tiny_config(), device="cpu") < real
    # on CUDA "auto" is fp16x3w, whose weights are split once
    assert weight_bytes(tiny_config(), longest_token) == real + codec_presplit_bytes(tiny_config(), "fp16x3w")


@pytest.mark.triton_interpret
@pytest.mark.parametrize("gemm", ["tf32x3w", "fp16x3w"])
def test_weight_bytes_count_the_codecs_presplit_weights(gemm):
    """Where decode_step's GEMMs run a pre-split kernel (gemm tf32x3w or fp16x3w on the CPU under the
    interpreter here; also "auto" on CUDA), cast_for_inference keeps every decoder GEMM weight split (two
    fp32 halves, or two fp16 halves and a scale per output channel: RVQCodec.presplit_weights), and
    weight_bytes counts them exactly."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = tiny_config()
    cfg = replace(cfg, codec=replace(cfg.codec, gemm=gemm))
    model = VoiceChat(cfg).to(device).cast_for_inference()
    model.perception.prepare_stream()
    model.codec.prvq.stacked()
    real = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    splits = [getattr(holder, name) for holder, name, _ in model.codec.decoder.step_gemms()]
    split_bytes = sum(t.numel() * t.element_size() for t in splits)
    assert split_bytes == codec_presplit_bytes(cfg, gemm) > 0 and all(t.numel() for t in splits)
    assert weight_bytes(cfg, device=device) == real


def test_full_size_weights_match_the_step_benchmark():
    """bench_step counted parameters only (bf16 parts, fp32 codec); buffers add under 1 %, besides the
    talker's derived tables (EarTTS.build_tables): a bf16 row per token id (131072 x 1152 x 2 bytes), the
    bf16 code table (31 x 1025 x 512 x 2) and the fp32 codebooks with their norms (31 x 1024 x 513 x 4);
    and the codec's pre-split decoder GEMM weights on CUDA (RVQCodec.presplit_weights)."""
    params = BENCH_STEP_H200["weight_bytes"]
    cfg = inference_config(ModelConfig(), "bf16")
    tables = derived_table_bytes(cfg)
    talker = 131072 * 1152 * 2 + 31 * 1025 * 512 * 2 + 31 * 1024 * 513 * 4
    # the codec's decoder GEMM weights split on CUDA ("auto" = fp16x3w: two fp16 halves per weight and an
    # fp32 scale per output channel; RVQCodec.presplit_weights): per stage the upsampling layer and three
    # ConvNeXt blocks' pwconv1 + pwconv2, then the final conv
    weights = (512 * 1536 * 9 + 3 * 2 * 6144 * 1536 + 1536 * 768 * 7 + 3 * 2 * 3072 * 768
               + 768 * 384 * 7 + 3 * 2 * 1536 * 384 + 384 * 18)
    channels = 1536 * 9 + 3 * (6144 + 1536) + 768 * 7 + 3 * (3072 + 768) + 384 * 7 + 3 * (1536 + 384) + 18
    assert 2 * 4 * weights == 733_796_352 == codec_presplit_bytes(cfg, "tf32x3w")
    assert tables == talker + 2 * 2 * weights + 4 * channels
    assert derived_table_bytes(cfg, "cpu") == talker   # the CPU without the interpreter: gemm "auto" is IEEE
    w = weight_bytes(cfg)
    assert params + tables <= w < params * 1.01 + tables


def test_plan_refuses_an_impossible_config_with_the_numbers():
    cfg = tiny_config()
    w = weight_bytes(cfg)
    with pytest.raises(MemoryPlanError) as e:
        plan(cfg, 100_000, 160.0, 1 * GiB, reserve=0, weights=w)
    msg = str(e.value)
    per_call = bytes_per_call(cfg, 160.0).total
    fit = (GiB - w) // per_call - 1
    for needle in ("engine.max_calls = 100000", "engine.max_call_s = 160 s", "1.00 GiB",
                   f"{per_call / 2**20:.1f} MiB per call", f"at most {fit} calls fit"):
        assert needle in msg, (needle, msg)


def test_the_limits_it_suggests_are_exact():
    cfg = tiny_config()
    w, reserve, mem = weight_bytes(cfg), 64 * 2**20, 2 * GiB
    n = max_calls_that_fit(cfg, 60.0, mem, w + reserve)
    assert n > 0
    assert plan(cfg, n, 60.0, mem, reserve=reserve, weights=w).fits
    with pytest.raises(MemoryPlanError):
        plan(cfg, n + 1, 60.0, mem, reserve=reserve, weights=w)
    s = max_call_s_that_fits(cfg, 200, mem, w + reserve)
    assert s > 0 and abs(s / cfg.frame_length - round(s / cfg.frame_length)) < 1e-9
    assert plan(cfg, 200, s, mem, reserve=reserve, weights=w).fits
    with pytest.raises(MemoryPlanError):
        plan(cfg, 200, s + cfg.frame_length, mem, reserve=reserve, weights=w)


def test_memory_grows_with_call_length_only_in_the_kv_caches():
    cfg = tiny_config()
    short, long = bytes_per_call(cfg, 10.0), bytes_per_call(cfg, 100.0)
    changed = {f.name for f in fields(short) if getattr(short, f.name) != getattr(long, f.name)}
    assert changed == {"llm_kv", "talker_kv"}
    frames = frames_per_call(cfg, 100.0) - frames_per_call(cfg, 10.0)
    t = cfg.talker.backbone
    per_frame = 2 * t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim * 4   # K+V, 2 streams, fp32
    assert long.talker_kv - short.talker_kv == frames * per_frame


def test_the_capacity_table_at_a_dtype_preset():
    """`python -m nemo_duplex.serving.memory capacity`: the docs' table at conf/model/dtype/capacity.yaml's
    dtypes, the SSM state and the talker's KV at half the bf16 deployment's bytes; an unknown preset is named."""
    def table(*args):
        return subprocess.run([sys.executable, "-m", "nemo_duplex.serving.memory", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    served, capacity = table().stdout, table("capacity").stdout
    assert "| mamba_ssm | 135.00 |" in served and "| mamba_ssm | 67.50 |" in capacity
    assert "| talker_kv | 101.39 | 193.68 | 501.29 |" in served and "| talker_kv | 50.70 | 96.84 | 250.65 |" in capacity
    missing = table("nope")
    assert missing.returncode != 0 and "no dtype preset 'nope'" in missing.stderr


def test_serve_refuses_to_start_when_the_calls_do_not_fit(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "scripts/serve.py"), "memory.device_gib=0.05",
                        "engine.max_calls=8", f"hydra.run.dir={tmp_path}"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1
    out = r.stdout + r.stderr
    assert "serve: refusing to run" in out and "engine.max_calls = 8" in out and "engine.max_call_s = 160 s" in out, out
    assert "budget memory.device_gib" in out and "Traceback" not in out, out


@pytest.mark.parametrize("app", ["serve", "run_clip"])
def test_an_app_refuses_a_model_that_does_not_fit_the_cpu_before_allocating(tmp_path, app):
    # The full-size model with random weights on the CPU: its weights alone (fp32, 42 GiB) exceed the budget,
    # so the app stops with the numbers before any weight is made (a 24 GiB machine would otherwise be killed
    # by the kernel's out-of-memory killer after a minute and a half).
    r = subprocess.run([sys.executable, str(REPO / f"scripts/{app}.py"), "model=nemotron_duplex", "model.weights=random",
                        "memory.device_gib=20", f"hydra.run.dir={tmp_path}"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout + r.stderr
    weights = weight_bytes(ModelConfig(), device="cpu") / GiB
    assert f"{app}: refusing to run" in out and f"{weights:.2f} GiB" in out, out
    assert "20.00 GiB" in out and "memory.device_gib" in out, out


def test_prefix_entry_bytes_match_a_snapshot():
    from nemo_duplex.serving.memory import prefix_entry_bytes
    from nemo_duplex.serving.state import PrefixCache

    cfg = tiny_config()
    model = VoiceChat(cfg).cast_for_inference()
    st = allocate_call_state(model, 2, frames_per_call(cfg, 1.0), torch.device("cpu"), 16)
    snap = PrefixCache.snapshot(st, 0, 16, cfg.prompt_frames)
    assert prefix_entry_bytes(cfg, 16) == sum(t.numel() * t.element_size() for t in snap.values())
    assert PrefixCache.entry_bytes(snap) == prefix_entry_bytes(cfg, 16)


def test_prefix_cache_is_bounded_in_bytes_not_entries():
    """engine.prefix_cache_mib: a long prompt's entry takes the room of several short ones (least recently
    used out first), the bytes held never exceed the bound, and an entry larger than the bound is not kept."""
    from nemo_duplex.serving.state import PrefixCache

    def snap(tokens: int) -> dict:   # an entry's shape: a fixed state plus the prompt's K/V (1 KiB a token)
        return {"ssm": torch.zeros(1024, dtype=torch.uint8), "k": torch.zeros(tokens, 512, dtype=torch.uint8),
                "v": torch.zeros(tokens, 512, dtype=torch.uint8)}

    short, long = PrefixCache.entry_bytes(snap(4)), PrefixCache.entry_bytes(snap(40))
    assert (short, long) == (5 * 1024, 41 * 1024)
    cache = PrefixCache(max_bytes=4 * short)
    for key in "abcd":
        cache.put((key,), snap(4))
    assert len(cache._entries) == 4 and cache.bytes == 4 * short
    assert cache.get(("a",)) is not None                 # a is now the most recently used
    cache.put(("big",), snap(40))                        # larger than the bound: not kept, nothing evicted
    assert cache.bytes == 4 * short and cache.get(("big",)) is None
    cache.put(("mid",), snap(12))                        # 13 KiB: needs the room of three short entries
    assert set(cache._entries) == {("a",), ("mid",)}     # b, c, d (least recently used) made room
    assert cache.bytes == short + 13 * 1024 <= cache.max_bytes
    cache.put(("mid",), snap(4))                         # the same key again replaces its entry
    assert cache.bytes == 2 * short and len(cache._entries) == 2
    off = PrefixCache(max_bytes=0)
    assert not off.wants(("a",)) and not off.wants(("a",))


def test_a_negative_prefix_cache_size_is_refused(tiny):
    from nemo_duplex.serving.engine import build_engine
    from nemo_duplex.settings import EngineConfig

    with pytest.raises(ValueError, match=r"engine.prefix_cache_mib = -1: .*>= 0"):
        build_engine(tiny[0], tiny[1], EngineConfig(max_calls=1, max_call_s=1.0, prefix_cache_mib=-1))


def test_paged_pools_hold_what_the_plan_counts_full_size_on_meta():
    """engine.kv_pool_gib: the paged allocation (full size, bf16, on the meta device) holds, beside one row
    per slot of everything but the KV, the GiB asked for in LLM and talker pages (less than a page of each
    lost to the floor, plus each pool's sink page), split as one call of engine.max_call_s splits them; the
    plan counts the same bytes. Unset, the pages are those of max_calls such calls."""
    from nemo_duplex.serving.memory import kv_bytes_per_position, kv_page_counts, kv_pages_per_call

    cfg = inference_config(ModelConfig(), "bf16")
    with torch.device("meta"):
        model = VoiceChat(cfg).cast_for_inference()
    llm_position, talker_position = kv_bytes_per_position(cfg)
    counts = kv_page_counts(cfg, 4, 160.0, 512, 64, pool_gib=2.5)
    st = allocate_call_state(model, 4, frames_per_call(cfg, 160.0), torch.device("meta"), 512, counts)
    kv = tensor_bytes(st.llm.k) + tensor_bytes(st.llm.v) + tensor_bytes(st.talker.k) + tensor_bytes(st.talker.v)
    sinks = 64 * (llm_position + talker_position)
    assert 2.5 * GiB - sinks <= kv - sinks <= 2.5 * GiB
    llm_call, talker_call = kv_pages_per_call(cfg, 160.0, 512, 64)
    assert abs(counts.llm / llm_call - counts.talker / talker_call) < 1 / talker_call   # as many calls' worth, to a page
    planned = plan(cfg, 4, 160.0, 200 * GiB, weights=0, reserve=0, kv_pool_gib=2.5)
    per = bytes_per_call(cfg, 160.0, 512)
    assert planned.pools == 5 * (per.total - per.llm_kv - per.talker_kv) + int(2.5 * GiB)
    whole = kv_page_counts(cfg, 4, 160.0, 512, 64)
    assert (whole.llm, whole.talker) == (4 * llm_call, 4 * talker_call)


def test_kv_pool_settings_that_cannot_work_are_refused():
    from nemo_duplex.serving.memory import kv_page_counts

    cfg = tiny_config()
    for page_len in (8, 48):
        with pytest.raises(ValueError, match="engine.kv_page_len"):
            kv_page_counts(cfg, 2, 10.0, 16, page_len)
    for pool in (0.0, -1.0):
        with pytest.raises(ValueError, match="engine.kv_pool_gib"):
            kv_page_counts(cfg, 2, 10.0, 16, 64, pool)
    full = inference_config(ModelConfig(), "bf16")
    with pytest.raises(MemoryPlanError, match=r"engine.kv_pool_gib = 200 GiB .* At most engine.kv_pool_gib = "):
        plan(full, 16, 160.0, 140 * GiB, kv_pool_gib=200.0)


def test_engine_max_calls_null_takes_the_places_the_device_holds():
    """engine.max_calls=null (the default): on a GPU the calls of max_call_s its memory holds, exactly the plan's
    limit (one more does not fit), at most the largest capture bucket; with engine.kv_pool_gib the slots beside
    the pool; 8 on the CPU. On the H200's memory at full size in bf16: the docs' 165 calls of 160 s."""
    from nemo_duplex.serving import memory
    from nemo_duplex.settings import CAPTURE_BUCKETS, EngineConfig

    assert max(CAPTURE_BUCKETS) == 256
    cfg = inference_config(ModelConfig())
    h200 = 143771 / 1024   # GiB, as the docs' table (memory.DEVICES)
    kw = dict(device_gib=h200, reserve_gib=6)

    def engine(**settings):
        return EngineConfig(**{"max_call_s": 160.0, "prefix_cache_mib": 1280, "max_prompt_tokens": 512, **settings})
    n = memory.calls_for_device(cfg, "cuda", engine(), **kw)
    assert n == 165
    budget, reserve, w = int(h200 * GiB), 6 * GiB, weight_bytes(cfg)
    assert plan(cfg, n, 160.0, budget, reserve=reserve, weights=w, prefix_cache_mib=1280).fits
    with pytest.raises(MemoryPlanError):
        plan(cfg, n + 1, 160.0, budget, reserve=reserve, weights=w, prefix_cache_mib=1280)
    assert memory.calls_for_device(cfg, "cuda", engine(max_call_s=30.0), **kw) == 256   # 438 fit: the largest bucket
    assert memory.calls_for_device(cfg, "cuda", engine(max_call_s=30.0, capture_buckets=[1, 32, 128]), **kw) == 128
    pooled = memory.calls_for_device(cfg, "cuda", engine(kv_pool_gib=90), **kw)
    assert 1 < pooled < 256
    assert plan(cfg, pooled, 160.0, budget, reserve=reserve, weights=w, prefix_cache_mib=1280, kv_pool_gib=90).fits
    with pytest.raises(MemoryPlanError):
        plan(cfg, pooled + 1, 160.0, budget, reserve=reserve, weights=w, prefix_cache_mib=1280, kv_pool_gib=90)
    assert memory.calls_for_device(cfg, "cuda", engine(), **{**kw, "device_gib": 20}) == 1  # refused later
    assert memory.calls_for_device(cfg, "cpu", engine(), **kw) == memory.CPU_CALLS == 8


def test_the_server_settles_a_null_max_calls_into_its_settings():
    from omegaconf import OmegaConf

    from nemo_duplex import runtime
    from nemo_duplex.serving.memory import calls_for_device
    from tests.apps import compose_app

    cfg = compose_app("serve")
    assert cfg.engine.max_calls is None                       # the default
    assert runtime.settle_max_calls(cfg, runtime.model_config(cfg), "cpu") == 8 and cfg.engine.max_calls == 8
    full = compose_app("serve", ["model=nemotron_duplex", "model/dtype=bf16", "memory.device_gib=140",
                                 "memory.reserve_gib=6"])
    engine = OmegaConf.to_object(full.engine)   # the composed node and the dataclass give the same places
    want = calls_for_device(runtime.model_config(full), "cuda", engine, device_gib=140, reserve_gib=6)
    assert 1 < want < 256 and runtime.settle_max_calls(full, runtime.model_config(full), "cuda") == want
    given = compose_app("serve", ["engine.max_calls=3"])
    assert runtime.settle_max_calls(given, runtime.model_config(given), "cuda") == 3   # a number given is kept
