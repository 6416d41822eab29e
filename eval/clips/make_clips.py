"""Make the English test clips with espeak-ng, or load a folder of WAVs instead.

    python eval/clips/make_clips.py --out outputs/clips [--trailing-silence-s 10] [--config conf/eval/clips.yaml]

Writes `<name>.wav` (16 kHz mono PCM16) per clip and `clips.json` (name, kind, text, duration, where each
segment starts and ends, sha256 of the WAV). The clip list is `conf/eval/clips.yaml`. Needs Debian's
`espeak-ng` (apt-get install espeak-ng).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eval.audio import read_wav, resample, write_wav  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "conf" / "eval" / "clips.yaml"
KINDS = ("question", "long_turn", "interruption", "silence", "tool_request", "noise", "user")


@dataclass
class ClipSpec:
    """One clip to make. segments: [{"say": text} | {"pause": s} | {"noise": "white"|"hiss", "seconds": s, "rms": r}]."""
    name: str
    kind: str
    segments: list[dict]


@dataclass
class ClipSetConfig:
    """conf/eval/clips.yaml (package eval.clips): the clips to make, and how espeak-ng says them."""
    items: list[ClipSpec] = field(default_factory=list)
    dir: str | None = None
    sample_rate: int = 16000
    voice: str = "en-us"
    speed: int = 150
    pitch: int = 50
    amplitude: int = 100
    lead_silence_s: float = 0.5
    trailing_silence_s: float = 10.0
    seed: int = 0

    @staticmethod
    def from_dict(d: dict) -> "ClipSetConfig":
        d = dict(d)
        items = [ClipSpec(name=i["name"], kind=i["kind"], segments=[dict(s) for s in i["segments"]])
                 for i in d.pop("items")]
        return ClipSetConfig(items=items, **d)


@dataclass
class Segment:
    kind: str          # say | pause | noise
    start_s: float
    end_s: float
    text: str = ""


@dataclass
class Clip:
    """A clip on disk. `text` is every word the user says in it ("" for silence and noise), None when
    unknown (a user's WAV without a transcript)."""
    name: str
    kind: str
    path: str
    text: str | None
    duration_s: float
    sample_rate: int
    speech_end_s: float | None = None   # when the last user word ends; the rest is the reply budget
    segments: list[Segment] = field(default_factory=list)
    sha256: str = ""

    def load(self) -> tuple[np.ndarray, int]:
        return read_wav(self.path)

    def to_dict(self) -> dict:
        return asdict(self)


def load_clip_config(path: str | Path = DEFAULT_CONFIG) -> ClipSetConfig:
    """Read a clips.yaml (the `eval.clips` node without Hydra)."""
    from omegaconf import OmegaConf

    return ClipSetConfig.from_dict(OmegaConf.to_container(OmegaConf.load(path), resolve=True))


def espeak_version() -> str:
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise FileNotFoundError("espeak-ng is not installed: apt-get install -y espeak-ng")
    return subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def speak(text: str, sample_rate: int, voice: str, speed: int, pitch: int, amplitude: int) -> np.ndarray:
    """espeak-ng -> float32 mono at `sample_rate` (espeak writes 22.05 kHz; resampled here)."""
    espeak_version()  # clear error when espeak-ng is missing
    with tempfile.TemporaryDirectory() as tmp:
        wav_path = Path(tmp) / "say.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-p", str(pitch), "-a", str(amplitude),
                        "-w", str(wav_path), text], check=True, capture_output=True)
        wav, sr = read_wav(wav_path)
    return resample(wav, sr, sample_rate)


def _noise(kind: str, seconds: float, rms: float, sample_rate: int, rng: np.random.Generator) -> np.ndarray:
    n = int(round(seconds * sample_rate))
    if kind == "white":
        x = rng.standard_normal(n)
    elif kind == "hiss":  # first difference of white noise: energy rising towards Nyquist
        x = np.diff(rng.standard_normal(n + 1))
    else:
        raise ValueError(f"unknown noise {kind!r}; expected white or hiss")
    return (x * rms / np.sqrt(np.mean(x ** 2))).astype(np.float32)


def render_clip(spec: ClipSpec, cfg: ClipSetConfig, rng: np.random.Generator) -> tuple[np.ndarray, list[Segment]]:
    """Lead silence, the segments in order, trailing silence. Returns (audio, segment timings)."""
    sr = cfg.sample_rate
    parts = [np.zeros(int(round(cfg.lead_silence_s * sr)), np.float32)]
    segments, t = [], cfg.lead_silence_s
    for seg in spec.segments:
        if "say" in seg:
            audio, kind, text = speak(seg["say"], sr, cfg.voice, cfg.speed, cfg.pitch, cfg.amplitude), "say", seg["say"]
        elif "pause" in seg:
            audio, kind, text = np.zeros(int(round(float(seg["pause"]) * sr)), np.float32), "pause", ""
        elif "noise" in seg:
            audio = _noise(seg["noise"], float(seg["seconds"]), float(seg["rms"]), sr, rng)
            kind, text = "noise", ""
        else:
            raise ValueError(f"clip {spec.name}: segment {seg} has none of say / pause / noise")
        parts.append(audio)
        segments.append(Segment(kind, t, t + len(audio) / sr, text))
        t += len(audio) / sr
    parts.append(np.zeros(int(round(cfg.trailing_silence_s * sr)), np.float32))
    return np.concatenate(parts), segments


def make_clips(out_dir: str | Path, cfg: ClipSetConfig | None = None, names: list[str] | None = None,
               trailing_silence_s: float | None = None) -> list[Clip]:
    """Make the clips of `cfg` (default: conf/eval/clips.yaml) under out_dir, write clips.json, and
    return them. `names` makes only those clips; `trailing_silence_s` overrides the config's."""
    cfg = cfg if cfg is not None else load_clip_config()
    if trailing_silence_s is not None:
        cfg = ClipSetConfig(**{**asdict(cfg), "items": cfg.items, "trailing_silence_s": trailing_silence_s})
    specs = [s for s in cfg.items if names is None or s.name in names]
    if names is not None and len(specs) != len(set(names)):
        raise KeyError(f"unknown clip names {sorted(set(names) - {s.name for s in specs})}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clips = []
    for index, spec in enumerate(cfg.items):
        if spec not in specs:
            continue
        if spec.kind not in KINDS:
            raise ValueError(f"clip {spec.name}: unknown kind {spec.kind!r}; expected one of {KINDS}")
        # One generator per clip index: a clip's noise does not depend on which other clips are made.
        audio, segments = render_clip(spec, cfg, np.random.default_rng([cfg.seed, index]))
        path = out / f"{spec.name}.wav"
        write_wav(path, audio, cfg.sample_rate)
        said = [s for s in segments if s.kind == "say"]
        clips.append(Clip(
            name=spec.name, kind=spec.kind, path=str(path), text=" ".join(s.text for s in said),
            duration_s=len(audio) / cfg.sample_rate, sample_rate=cfg.sample_rate,
            speech_end_s=said[-1].end_s if said else None, segments=segments,
            sha256=hashlib.sha256(path.read_bytes()).hexdigest()))
    manifest = {"espeak_ng": espeak_version(), "config": {k: v for k, v in asdict(cfg).items() if k != "items"},
                "clips": [c.to_dict() for c in clips]}
    (out / "clips.json").write_text(json.dumps(manifest, indent=2))
    return clips


def load_clips(folder: str | Path) -> list[Clip]:
    """Clips from a folder: its clips.json when there is one, else every *.wav (kind "user") with the
    text of a `<name>.txt` beside it, or None when there is none."""
    folder = Path(folder)
    manifest = folder / "clips.json"
    if manifest.exists():
        clips = []
        for c in json.loads(manifest.read_text())["clips"]:
            c = dict(c, segments=[Segment(**s) for s in c.get("segments", [])])
            path = Path(c["path"])
            c["path"] = str(path if path.is_absolute() and path.exists() else folder / path.name)
            clips.append(Clip(**c))
        return clips
    wavs = sorted(folder.glob("*.wav"))
    if not wavs:
        raise FileNotFoundError(f"{folder} has neither clips.json nor *.wav files")
    clips = []
    for wav_path in wavs:
        audio, sr = read_wav(wav_path)
        txt = wav_path.with_suffix(".txt")
        clips.append(Clip(name=wav_path.stem, kind="user", path=str(wav_path),
                          text=txt.read_text().strip() if txt.exists() else None,
                          duration_s=len(audio) / sr, sample_rate=sr,
                          sha256=hashlib.sha256(wav_path.read_bytes()).hexdigest()))
    return clips


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/clips", help="output folder")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="clip list (clips.yaml)")
    parser.add_argument("--trailing-silence-s", type=float, default=None, help="override the config's")
    parser.add_argument("--names", nargs="*", default=None, help="make only these clips")
    args = parser.parse_args(argv)
    clips = make_clips(args.out, load_clip_config(args.config), args.names, args.trailing_silence_s)
    for c in clips:
        print(f"{c.name:20s} {c.kind:13s} {c.duration_s:6.2f} s  {c.text!r}")
    print(f"wrote {len(clips)} clips and clips.json to {args.out}")


if __name__ == "__main__":
    main()
