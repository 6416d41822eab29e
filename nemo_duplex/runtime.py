"""From an app's settings to a ready model, with one source of truth for every setting.

The order every app follows (`load`):
1. the checkpoint is resolved (a directory, a Hugging Face repo id through its cache, or `embedded`, the
   seeded tiny checkpoint of the tiny preset; nothing else ever makes weights up), failing within seconds
   with what was looked for, where, and the ways forward;
2. the effective model settings: the checkpoint's config.json supplies the architecture, which the
   command line cannot contradict (a conflicting dimension is an error naming both values), and the
   default generation settings, over which the command line wins (`merge_checkpoint_settings`);
3. the model (and, for a server, its call pools) is checked against the device's memory, CPU included,
   before anything is allocated;
4. the weights load strictly and each part is cast to its dtype.

`summary` and `write_settings` print and record what an app runs with.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nemo_duplex import REPO
from nemo_duplex.checkpoint.hub import EMBEDDED, CheckpointNotFound, CheckpointSource, resolve_checkpoint
from nemo_duplex.models.config import ModelConfig

DEFAULT_CHECKPOINTS = REPO / "outputs" / "checkpoints"
log = logging.getLogger("nemo_duplex")

# Settings the checkpoint's config.json gives as defaults, which the command line may change (spec 4.7).
# The rest of what config.json says is architecture. top_p and top_k are one choice (inference_top_p_or_k).
GENERATION_SETTINGS = ("talker.guidance_scale", "talker.top_p", "talker.top_k", "talker.noise_scale",
                       "talker.force_silence_on_eos", "talker.speaker")
_TOP_P_OR_K = ("talker.top_p", "talker.top_k")


class SettingsError(ValueError):
    """Settings that contradict each other or the checkpoint; the message names both sides."""


def model_config(cfg: DictConfig) -> ModelConfig:
    """The `model` node of a composed app config as a ModelConfig (the preset with the command line's values)."""
    return OmegaConf.to_object(cfg.model) if OmegaConf.is_config(cfg.model) else cfg.model


# ---- which settings the user gave ---------------------------------------------------------------------
def cli_overrides() -> list[str]:
    """The command line's overrides of the running Hydra app ([] outside one)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def explicit_keys(overrides: list[str], prefix: str = "model.") -> set[str]:
    """The dotted keys under `prefix` that the overrides set (`model.talker.noise_scale=0` ->
    "talker.noise_scale"); group choices (`model=...`, `model/dtype=...`) are not keys."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = set()
    for o in OverridesParser.create().parse_overrides(overrides):
        k = o.key_or_group
        if k.startswith(prefix):
            keys.add(k[len(prefix):])
    return keys


def _given(path: str, explicit: set[str]) -> bool:
    return any(path == k or path.startswith(k + ".") for k in explicit)


def _leaves(obj, prefix: str = "") -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out.update(_leaves(v, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = v
    return out


def _set(obj, path: str, value):
    head, _, rest = path.partition(".")
    if not rest:
        return dataclasses.replace(obj, **{head: value})
    return dataclasses.replace(obj, **{head: _set(getattr(obj, head), rest, value)})


@dataclass
class MergedSettings:
    cfg: ModelConfig
    from_command_line: dict[str, tuple[Any, Any]] = field(default_factory=dict)   # key: (yours, checkpoint's)
    replaced: dict[str, tuple[Any, Any]] = field(default_factory=dict)   # preset's generation value -> checkpoint's
    architecture_changed: list[str] = field(default_factory=list)   # preset dims the checkpoint replaced


def merge_checkpoint_settings(requested: ModelConfig, from_checkpoint: ModelConfig,
                              explicit: set[str]) -> MergedSettings:
    """The effective settings. `requested` is the preset with the command line's values; `from_checkpoint`
    is the same with the checkpoint's config.json over it (checkpoint.read_config); `explicit` the keys the
    command line set. A generation setting the command line gave stays (it wins over the checkpoint's
    default); one it did not give takes the checkpoint's value (warned about when the preset had set
    another). An architecture value the command line gave must equal the checkpoint's: else SettingsError
    naming both."""
    merged = MergedSettings(from_checkpoint)
    defaults = _leaves(ModelConfig())
    mine, theirs = _leaves(requested), _leaves(from_checkpoint)
    conflicts = []
    for path, ours in mine.items():
        ckpt = theirs[path]
        if ours == ckpt:
            continue
        if path in GENERATION_SETTINGS:
            group = _TOP_P_OR_K if path in _TOP_P_OR_K else (path,)
            if any(_given(p, explicit) for p in group):
                merged.cfg = _set(merged.cfg, path, ours)
                merged.from_command_line[path] = (ours, ckpt)
            elif ours != defaults[path]:
                merged.replaced[path] = (ours, ckpt)
        elif _given(path, explicit):
            conflicts.append(f"model.{path}={ours!r} on the command line, but the checkpoint's config.json "
                             f"says {ckpt!r}")
        elif path != "pretrained_llm":   # where the LLM's tokenizer and HF config are, not a dimension
            merged.architecture_changed.append(path)
    if conflicts:
        raise SettingsError("the command line contradicts the checkpoint's architecture (drop these overrides, "
                            "or use a checkpoint made with them):\n  " + "\n  ".join(conflicts))
    return merged


# ---- the checkpoint ---------------------------------------------------------------------------------
def embedded_checkpoint(mcfg: ModelConfig, seed: int = 0) -> Path:
    """The seeded random checkpoint of `mcfg`, written once under outputs/checkpoints/. Written into a
    temporary sibling and renamed into place (one atomic step), so processes starting together (a server
    and a client, test workers) never read a half-written one; a process that loses the race drops its copy."""
    from nemo_duplex.checkpoint.random_weights import make_random_checkpoint

    out = DEFAULT_CHECKPOINTS / f"{mcfg.name}-seed{seed}"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would stay with the checkpoint after the rename
        try:
            make_random_checkpoint(mcfg, staging, seed)
            if out.exists() and not (out / "config.json").exists():
                shutil.rmtree(out, ignore_errors=True)  # a partial one left by an older, non-atomic writer
            try:
                os.rename(staging, out)
            except OSError:  # another process renamed its copy first (same seed: the same checkpoint)
                if not (out / "config.json").exists():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out


@dataclass
class ResolvedModel:
    """What an app will load, known before any weight is read."""
    cfg: ModelConfig
    source: CheckpointSource | None        # None: model.weights=random
    settings: MergedSettings | None = None
    notes: list[str] = field(default_factory=list)
    embedded: bool = False                 # the tiny preset's seeded checkpoint

    @property
    def random_weights(self) -> bool:
        """Weights that are noise by construction: model.weights=random, the embedded checkpoint, or a checkpoint
        whose config.json says so (scripts/make_checkpoint.py writes `"random_weights": true`)."""
        if self.source is None or self.embedded:
            return True
        return bool(json.loads((self.source.path / "config.json").read_text()).get("random_weights", False))


def resolve_model(cfg: DictConfig, overrides: list[str] | None = None) -> ResolvedModel:
    """Steps 1 and 2 of the module docstring: no weights are read. `overrides` are the command line's (by
    default the running Hydra app's)."""
    overrides = cli_overrides() if overrides is None else overrides
    requested = model_config(cfg)
    spec = str(cfg.checkpoint)
    if requested.weights == "random":
        if any(o.split("=")[0].lstrip("+~") == "checkpoint" for o in overrides):
            raise SettingsError(f"checkpoint={spec} and model.weights=random: random weights load no checkpoint; "
                                "drop one of the two")
        return ResolvedModel(requested, None, notes=["random weights: for speed measurements only; the text and "
                                                     "speech are noise"])
    if requested.weights != "checkpoint":
        raise SettingsError(f"model.weights must be checkpoint or random, not {requested.weights!r}")
    if spec == EMBEDDED:
        source = CheckpointSource(embedded_checkpoint(requested))
        notes = [f"the embedded {requested.name} checkpoint (seeded random weights: the pipeline is real, its text "
                 "and speech are noise)"]
    else:
        source = resolve_checkpoint(spec, cfg.get("revision"))
        notes = []
    from nemo_duplex.checkpoint.official import read_config  # (torch: imported once a checkpoint is there to read)

    merged = merge_checkpoint_settings(requested, read_config(source.path, requested),
                                       explicit_keys(overrides))
    if merged.architecture_changed:
        changed = merged.architecture_changed
        notes.append(f"architecture from the checkpoint's config.json; it differs from the model={requested.name} "
                     "preset in " + (", ".join(changed) if len(changed) <= 4 else f"{len(changed)} values"))
    for path, (ours, ckpt) in merged.replaced.items():
        log.warning("model.%s: the preset's %r is replaced by the checkpoint's %r (give it on the command line "
                    "to keep it)", path, ours, ckpt)
    return ResolvedModel(merged.cfg, source, merged, notes, embedded=spec == EMBEDDED)


# ---- loading ------------------------------------------------------------------------------------------
BLAS_LIBRARIES = ("cublaslt", "cublas")


def select_blas(library: str) -> None:
    """The library torch's CUDA bf16 / fp32 GEMMs go through, for the whole process (graphs capture the
    kernels it picks, so this comes before any capture). "cublaslt" (the default, `engine.blas_library`):
    its heuristics pick faster kernels for the step's 32- and 128-row GEMMs than cuBLAS's on the H200, the
    two captured side by side in one process and timed alternately: N=32 17.77 -> 17.60 ms, N=128
    39.38 -> 38.96 ms (docs/performance.md)."""
    import torch

    if library not in BLAS_LIBRARIES:
        raise ValueError(f"engine.blas_library must be one of {BLAS_LIBRARIES}, got {library!r}")
    torch.backends.cuda.preferred_blas_library(library)


def check_memory(cfg: DictConfig, mcfg: ModelConfig, device,
                 calls: tuple[int, float] | None = None):
    """Step 3: the weights (and `calls` = (max_calls, max_call_s) pools) against the device's memory,
    under the app's `memory` settings. Raises memory.MemoryPlanError with the numbers."""
    from nemo_duplex.serving.memory import check_fits

    m = cfg.get("memory") or {}
    engine = cfg.get("engine") or {}
    return check_fits(mcfg, device, check=bool(m.get("check", True)), device_gib=m.get("device_gib"),
                      reserve_gib=m.get("reserve_gib"), calls=calls,
                      max_prompt_tokens=int(engine.get("max_prompt_tokens", 512)),
                      prefix_cache_mib=int(engine.get("prefix_cache_mib", 0)) if calls else 0,
                      kv_pool_gib=engine.get("kv_pool_gib") if calls else None)


def settle_max_calls(cfg: DictConfig, mcfg: ModelConfig, device) -> int:
    """engine.max_calls as the engine runs it: the setting, or for null (the default) the places the device
    holds (memory.calls_for_device: on a GPU what its memory fits, at most the largest capture bucket; 8 on the
    CPU). Written back into cfg, so that what reads it later, the settings record included, has the number."""
    from nemo_duplex.serving.memory import calls_for_device

    engine = cfg.engine
    if engine.max_calls is None:
        m = cfg.get("memory") or {}
        engine.max_calls = calls_for_device(mcfg, device, engine, device_gib=m.get("device_gib"),
                                            reserve_gib=m.get("reserve_gib"))
    return int(engine.max_calls)


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    rnnt_vocab: Any
    cfg: ModelConfig
    resolved: ResolvedModel
    memory: Any = None   # the memory.MemoryPlan it was checked against (None with memory.check=false)

    def __iter__(self):   # model, tokenizer, rnnt_vocab, cfg = load(...)
        return iter((self.model, self.tokenizer, self.rnnt_vocab, self.cfg))


def load(cfg: DictConfig, device=None, overrides: list[str] | None = None,
         calls: tuple[int, float] | None = None, resolved: ResolvedModel | None = None) -> Loaded:
    """Steps 1-4 of the module docstring; `device` (a str or torch.device) defaults to cfg.device. On CUDA it
    also selects the GEMM library (`engine.blas_library`)."""
    import torch

    from nemo_duplex.checkpoint.load import load_weights, with_token_ids
    from nemo_duplex.checkpoint.random_weights import random_model

    resolved = resolved or resolve_model(cfg, overrides)
    device = torch.device(device or cfg.get("device", "cpu"))
    plan = check_memory(cfg, resolved.cfg, device, calls)
    if device.type == "cuda":
        select_blas(OmegaConf.select(cfg, "engine.blas_library", default="cublaslt"))
    if resolved.source is None:
        model, tokenizer, rnnt_vocab = random_model(resolved.cfg, device, seed=int(cfg.get("seed", 0) or 0))
        mcfg = with_token_ids(resolved.cfg, tokenizer)
    else:
        model, tokenizer, rnnt_vocab, mcfg = load_weights(resolved.source.path, resolved.cfg, device,
                                                          cfg.get("tokenizer"))
    model.cast_for_inference().eval()
    return Loaded(model, tokenizer, rnnt_vocab, mcfg, resolved, plan)


# ---- what an app runs with -------------------------------------------------------------------------------
def summary(cfg: DictConfig, loaded: Loaded | ResolvedModel, app: str, extra: list[str] = ()) -> str:
    """A short account of the settings an app runs with (printed at start)."""
    r = loaded.resolved if isinstance(loaded, Loaded) else loaded
    m = loaded.cfg
    t = m.talker
    sampling = "top-k %d" % t.top_k if t.top_k > 0 else f"top-p {t.top_p:g}"
    lines = [f"{app}: model {m.name} on {cfg.get('device', 'cpu')} "
             f"(dtypes encoder {m.dtype.encoder}, llm {m.dtype.llm}, talker {m.dtype.talker}, codec {m.dtype.codec})",
             "  weights: " + (r.source.describe() if r.source is not None else "random (model.weights=random)"),
             f"  talker: guidance {t.guidance_scale:g}, {sampling}, noise {t.noise_scale:g}, voice {t.speaker}"]
    if r.settings is not None and r.settings.from_command_line:
        lines.append("  from the command line over the checkpoint's defaults: " + ", ".join(
            f"model.{k}={v[0]!r} (checkpoint: {v[1]!r})" for k, v in r.settings.from_command_line.items()))
    lines += [f"  {n}" for n in r.notes]
    if isinstance(loaded, Loaded) and loaded.memory is not None:
        lines.append(f"  {loaded.memory.summary()}")
    lines += [f"  {e}" for e in extra]
    return "\n".join(lines)


def effective_settings(cfg: DictConfig, loaded: Loaded | ResolvedModel) -> dict:
    """The app's settings as run: the composed config, resolved, with `model` replaced by the effective
    model settings and where the weights came from."""
    r = loaded.resolved if isinstance(loaded, Loaded) else loaded
    out = OmegaConf.to_container(cfg, resolve=True)
    out["model"] = dataclasses.asdict(loaded.cfg)
    src = r.source
    out["weights_source"] = ({"random": True} if src is None else
                             {"path": str(src.path), "repo_id": src.repo_id, "revision": src.revision,
                              "commit": src.commit})
    if r.settings is not None:
        out["from_command_line"] = {k: v[0] for k, v in r.settings.from_command_line.items()}
    return out


def write_settings(run_dir: str | Path, cfg: DictConfig, loaded: Loaded | ResolvedModel) -> Path:
    """`<run_dir>/settings.yaml`: effective_settings, the record of what the run used."""
    path = Path(run_dir) / "settings.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(effective_settings(cfg, loaded))))
    return path


@contextlib.contextmanager
def refusals(app: str):
    """Inside an app's main: a setting, checkpoint or memory refusal ends the process with its message
    and exit status 1 (no traceback: the message says what to change)."""
    try:
        yield
    except Exception as e:
        if isinstance(e, _refusal_types()):
            raise SystemExit(f"{app}: refusing to run: {e}") from None
        raise


def _refusal_types() -> tuple[type, ...]:
    """The refusals' exception types. checkpoint.py and memory.py import torch, so theirs are looked up only
    where those modules were loaded (an exception of theirs cannot have been raised otherwise): a refusal
    before any checkpoint is read ends without importing torch."""
    kinds: list[type] = [SettingsError, CheckpointNotFound]
    for module, name in (("nemo_duplex.checkpoint.files", "CheckpointError"), ("nemo_duplex.serving.memory", "MemoryPlanError")):
        if module in sys.modules:
            kinds.append(getattr(sys.modules[module], name))
    return tuple(kinds)


def run_dir() -> Path | None:
    """The running Hydra app's output directory (None outside one)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None
