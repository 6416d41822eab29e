"""What a gate row is given and what it returns (shared by eval/gate.py and the row modules).

A row is `def my_row(ctx: GateContext, criteria: Criteria) -> RowResult`. It reads clips, models and
run settings from `ctx`, its thresholds from `criteria` (read-only, fixed before the run), and ends
pass, fail or n/a; fail and n/a always say why.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import numpy as np
from tqdm import tqdm

from eval.clips.make_clips import Clip
from eval.report import AudioSample
from eval.wer import Transcriber

if TYPE_CHECKING:
    from eval.models import ModelSet

PASS, FAIL, NA = "pass", "fail", "n/a"
SPEECH_KINDS = ("question", "long_turn", "interruption", "tool_request")
NON_SPEECH_KINDS = ("silence", "noise")

Criteria = Mapping[str, Any]  # read-only: MappingProxyType, lists as tuples


@dataclass
class RowResult:
    """What a row returns. `reason` is required for fail and n/a; `audio` are samples worth hearing."""
    status: str
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    audio: list[AudioSample] = field(default_factory=list)

    def __post_init__(self):
        if self.status not in (PASS, FAIL, NA):
            raise ValueError(f"row status must be {PASS!r}, {FAIL!r} or {NA!r}, not {self.status!r}")
        if self.status != PASS and not self.reason:
            raise ValueError(f"a {self.status} row must say why (reason)")


@dataclass
class AgentReply:
    """The agent's answer to one clip: its text channel and its audio."""
    text: str
    audio: np.ndarray
    sample_rate: int


@dataclass
class GateContext:
    """What rows may use.

    - `respond`: the model runner for agent replies (clip -> AgentReply); None when no model is plugged in.
    - `load_models`: builds the `ModelSet` (fp32 yardstick, bf16 variant, configured model) on first use
      of `models()`; None when the run has no model (the model rows then fail and say so).
    - `settings`: what the model rows run (clips, crop length, chunk sizes, batch size, graphs): the
      `eval.models` node of conf/eval/gate.yaml. Not criteria: it says what to measure, not what passes.
    The ASR model is loaded on first use by `transcriber()` and kept here."""
    clips: list[Clip]
    out_dir: Path
    checkpoint_kind: str                                   # random | trained
    asr_backend: str = "pocketsphinx"
    asr_model_path: str | None = None
    respond: Callable[[Clip], AgentReply] | None = None
    show_progress: bool = True
    load_models: Callable[[], "ModelSet"] | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    _transcriber: Transcriber | None = None
    _models: "ModelSet | None" = None

    def transcriber(self) -> Transcriber:
        if self._transcriber is None:
            self._transcriber = Transcriber(self.asr_backend, self.asr_model_path)
        return self._transcriber

    def models(self) -> "ModelSet":
        if self._models is None:
            if self.load_models is None:
                raise RuntimeError("this gate run has no model (GateContext.load_models is None)")
            self._models = self.load_models()
        return self._models

    def progress(self, items: Iterable, desc: str) -> Iterable:
        items = list(items)
        return tqdm(items, desc=desc, leave=False, disable=not self.show_progress)

    def clips_of(self, kinds: tuple[str, ...]) -> list[Clip]:
        return [c for c in self.clips if c.kind in kinds]

    def model_clips(self) -> list[Clip]:
        """The clips the model rows run: those of the run named in `settings["clips"]` (None = all).
        When eval.only_clips leaves none of them, every clip of the run."""
        names = self.settings.get("clips")
        chosen = [c for c in self.clips if names is None or c.name in names]
        return chosen or list(self.clips)
