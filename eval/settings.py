"""The settings schema of the evaluation apps (eval/gate.py and its rows, eval/clips.py), registered with
Hydra's ConfigStore like the apps' of nemo_duplex/settings.py. The criteria and the clip list are data
(conf/eval/gate.yaml, conf/eval/clips.yaml); their keys are typed here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from eval.clips.make_clips import ClipSetConfig
from nemo_duplex.settings import EngineConfig, ModelApp, SamplingParams, WandbConfig


@dataclass
class AsrConfig:
    backend: str = "pocketsphinx"     # pocketsphinx (no download) | whisper (needs model_path)
    model_path: Optional[str] = None  # a local whisper model: .pt (openai-whisper), CTranslate2 dir or transformers dir


@dataclass
class ModelRows:
    """What the model rows run (eval/models.py): not criteria, what to measure."""
    clips: Optional[list[str]] = None   # of the run's clips; null = all of them
    max_seconds: Optional[float] = 6.0  # each clip cut to this (then to whole 80 ms frames); null = whole clips
    seed: int = 0                       # per-call seed (talker noise); text is greedy
    bf16_dtype: dict[str, str] = field(default_factory=lambda: {"encoder": "bf16", "llm": "bf16", "talker": "bf16",
                                                                "mamba_ssm_state": "fp32"})
    chunk_sizes: list[int] = field(default_factory=lambda: [320, 1280, 4000])   # live clients' append sizes
    batch_calls: int = 32               # calls in the consistency row's staggered engine batch
    graphs: Any = "auto"                # auto: engine eager, and captured as well where a GPU is present | true | false
    graph_backend: str = EngineConfig.graph_backend   # reduce-overhead | cudagraph | cudagraph-eager (graphs/capture.py)
    cpu_threads: Optional[int] = 1      # torch threads on the CPU (the tiny model's ops are too small to share)


@dataclass
class GateConfig:
    """conf/eval/gate.yaml: the rows, their criteria (fixed before the run) and what they run on."""
    rows: list[str] = field(default_factory=list)
    only_clips: Optional[list[str]] = None
    checkpoint_kind: str = "auto"       # auto | random | trained (eval/gate.py resolve_checkpoint_kind)
    asr: AsrConfig = field(default_factory=AsrConfig)
    audio_samples: int = 4              # audio samples to W&B and <out>/audio/
    out_dir: Optional[str] = None       # null = the run directory
    models: ModelRows = field(default_factory=ModelRows)
    criteria: dict[str, dict[str, Any]] = field(default_factory=dict)
    clips: ClipSetConfig = field(default_factory=ClipSetConfig)


@dataclass
class GateApp(ModelApp):
    """eval/gate.py."""
    eval: GateConfig = field(default_factory=GateConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class EvalSettings:
    """eval/clips.py's `clip_eval` (eval/clips/evaluate.py)."""
    voiced_db: float = -40.0        # agent output frame RMS (dBFS) above which the agent is speaking
    user_voiced_db: float = -40.0   # input frame RMS above which the user is speaking (clips without timing)
    plots: bool = True
    max_labels: int = 80            # text pieces written on a timeline (the rest are ticks only)


@dataclass
class ClipsEval:
    asr: AsrConfig = field(default_factory=AsrConfig)
    checkpoint_kind: str = "auto"
    cpu_threads: Optional[int] = 1


@dataclass
class ClipsApp(ModelApp):
    """eval/clips.py: offline evaluation of a folder of clips (eval/clips/evaluate.py)."""
    dir: Optional[str] = None         # folder of WAVs (any rate); <name>.txt = the user's words, or a clips.json
    mode: str = "streaming"           # streaming (spec 7.2: what the server runs) | offline (spec 7.1)
    prompt: Optional[str] = None
    seed: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    out: Optional[str] = None
    clip_eval: EvalSettings = field(default_factory=EvalSettings)
    eval: ClipsEval = field(default_factory=ClipsEval)


def register() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="gate_schema", node=GateApp)
    cs.store(name="clips_schema", node=ClipsApp)
