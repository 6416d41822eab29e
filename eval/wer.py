"""Word error rate of speech: offline ASR, text normalisation, jiwer scoring, and a speech check.

The gate scores the agent's audio against the agent's own text: the talker must say what the
LLM wrote. ASR backends:
- `pocketsphinx` (default): needs no download, its US English model ships in the wheel. It is weak
  (measured on the espeak clips: see tests/test_wer.py), so WER bounds for it are loose.
- `whisper`: only with a local `model_path`. A `.pt` file loads with `openai-whisper`, a directory
  holding `model.bin` with `faster-whisper` (CTranslate2), a directory holding `config.json` with
  `transformers`. The package a path needs may be absent; that is a clear error, never a fallback.

`is_speech` does not trust loudness: an RMS "voiced" check once passed pure hiss (LANDSCAPE 5, mstar
`asr_check.py`). It asks for pitch-periodic, low zero-crossing frames, syllable-like energy modulation
and at least one recognised word.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

import jiwer
import numpy as np

from eval.audio import resample, to_pcm16

ASR_SAMPLE_RATE = 16000
BACKENDS = ("pocketsphinx", "whisper")


# ---------------------------------------------------------------------------------------------------
# Text normalisation and WER


def normalize_text(text: str) -> str:
    """Lowercase, drop punctuation (apostrophes inside words stay: "what's"), split hyphens, collapse
    whitespace. Digits are kept as they are: clip texts spell numbers out."""
    t = text.lower().replace("\u2019", "'").replace("\u2018", "'")
    t = re.sub(r"\(\d+\)", " ", t)  # pocketsphinx alternate-pronunciation marks, "word(2)"
    t = re.sub(r"[^a-z0-9' ]+", " ", t)
    words = [w.strip("'") for w in t.split()]
    return " ".join(w for w in words if w)


def wer(reference: str | list[str], hypothesis: str | list[str]) -> float:
    """Word error rate after `normalize_text`. Lists are scored as one corpus (total edits / total
    reference words), not as a mean of per-utterance rates. An empty reference has no defined WER and
    raises, unless the hypothesis is empty as well (0.0)."""
    refs = [reference] if isinstance(reference, str) else list(reference)
    hyps = [hypothesis] if isinstance(hypothesis, str) else list(hypothesis)
    if len(refs) != len(hyps):
        raise ValueError(f"{len(refs)} references but {len(hyps)} hypotheses")
    refs = [normalize_text(r) for r in refs]
    hyps = [normalize_text(h) for h in hyps]
    pairs = [(r, h) for r, h in zip(refs, hyps) if r or h]
    if not pairs:
        return 0.0
    if any(not r for r, _ in pairs):
        raise ValueError("a reference is empty after normalisation while its hypothesis is not; "
                         "WER is undefined there: drop that pair or score it separately")
    return float(jiwer.wer([r for r, _ in pairs], [h for _, h in pairs]))


# ---------------------------------------------------------------------------------------------------
# ASR


def trim_silence(wav: np.ndarray, sample_rate: int, floor_db: float = -45.0, pad_s: float = 0.2) -> np.ndarray:
    """Cut leading and trailing frames quieter than `floor_db` below the loudest 20 ms frame (and
    below -60 dBFS absolute), keeping `pad_s` around the rest. ASR is ~1x real time on 2 CPU cores, and
    pocketsphinx hallucinates words on long silences, so replies padded with seconds of silence are
    trimmed first. Returns an empty array when nothing is above the floor."""
    frame = int(0.02 * sample_rate)
    n = len(wav) // frame
    if n == 0:
        return wav[:0]
    rms = np.sqrt(np.mean(wav[: n * frame].reshape(n, frame).astype(np.float64) ** 2, axis=1))
    threshold = max(rms.max() * 10 ** (floor_db / 20), 1e-3)
    loud = np.flatnonzero(rms > threshold)
    if len(loud) == 0:
        return wav[:0]
    pad = int(pad_s * sample_rate)
    return wav[max(0, loud[0] * frame - pad): min(len(wav), (loud[-1] + 1) * frame + pad)]


class Transcriber:
    """An ASR model loaded once, called on many clips. `transcriber(wav, sample_rate) -> str`.

    Args:
        backend: "pocketsphinx" or "whisper".
        model_path: local model for "whisper" (required there); unused by pocketsphinx.
        language: whisper decoding language.
    """

    def __init__(self, backend: str = "pocketsphinx", model_path: str | None = None, language: str = "en"):
        if backend not in BACKENDS:
            raise ValueError(f"unknown ASR backend {backend!r}; expected one of {BACKENDS}")
        self.backend, self.model_path, self.language = backend, model_path, language
        if backend == "pocketsphinx":
            self._decode = self._load_pocketsphinx()
        else:
            self._decode = self._load_whisper()

    def __call__(self, wav: np.ndarray, sample_rate: int) -> str:
        x = np.asarray(wav, np.float32)
        if x.ndim != 1:
            raise ValueError(f"expected mono audio [T], got shape {x.shape}")
        x = resample(x, sample_rate, ASR_SAMPLE_RATE)
        x = trim_silence(x, ASR_SAMPLE_RATE)
        if len(x) < ASR_SAMPLE_RATE // 10:  # under 0.1 s of sound: nothing to recognise
            return ""
        return normalize_text(self._decode(x))

    def _load_pocketsphinx(self):
        from pocketsphinx import Decoder  # the default US English model ships inside the wheel

        # maxhmmpf 3000 (default 30000) prunes the search: ~3x faster on 2 cores, and the espeak clips'
        # corpus WER moved from 0.31 to 0.32.
        decoder = Decoder(samprate=ASR_SAMPLE_RATE, loglevel="FATAL", maxhmmpf=3000)

        def decode(x: np.ndarray) -> str:
            # pocketsphinx's log-energy features break on exact digital silence (espeak's pauses): on the
            # espeak clips WER was ~0.77 without a noise floor and ~0.35 with a -60 dBFS one (32 LSB RMS).
            # The floor is seeded, so a clip always gives the same transcript.
            floor = np.random.default_rng(0).standard_normal(len(x)).astype(np.float32) * (32 / 32768)
            decoder.start_utt()
            decoder.process_raw(to_pcm16(x + floor).tobytes(), full_utt=True)
            decoder.end_utt()
            hyp = decoder.hyp()
            return hyp.hypstr if hyp is not None else ""

        return decode

    def _load_whisper(self):
        if not self.model_path:
            raise ValueError("the whisper ASR backend needs a local model: set asr.model_path to a "
                             "whisper .pt file, a faster-whisper (CTranslate2) directory or a transformers "
                             "directory; nothing is downloaded. Or use asr.backend=pocketsphinx.")
        path = Path(self.model_path)
        if not path.exists():
            raise FileNotFoundError(f"whisper model path {path} does not exist")
        if path.is_file() and path.suffix == ".pt":
            return self._load_openai_whisper(path)
        if path.is_dir() and (path / "model.bin").exists():
            return self._load_faster_whisper(path)
        if path.is_dir() and (path / "config.json").exists():
            return self._load_transformers_whisper(path)
        raise ValueError(f"{path}: not a whisper model (expected a .pt file, or a directory with "
                         "model.bin (faster-whisper) or config.json (transformers))")

    def _load_openai_whisper(self, path: Path):
        try:
            import whisper
        except ImportError as e:
            raise ImportError(f"{path} is an openai-whisper checkpoint but the `openai-whisper` package "
                              "is not installed (pip install openai-whisper)") from e
        model = whisper.load_model(str(path), device="cpu")
        return lambda x: model.transcribe(x, language=self.language, fp16=False)["text"]

    def _load_faster_whisper(self, path: Path):
        try:
            from faster_whisper import WhisperModel
        except ImportError as e:
            raise ImportError(f"{path} is a faster-whisper (CTranslate2) model but the `faster-whisper` "
                              "package is not installed (pip install faster-whisper)") from e
        model = WhisperModel(str(path), device="cpu", compute_type="int8")

        def decode(x: np.ndarray) -> str:
            segments, _ = model.transcribe(x, language=self.language, beam_size=5)
            return " ".join(s.text for s in segments)

        return decode

    def _load_transformers_whisper(self, path: Path):
        import torch
        from transformers import WhisperForConditionalGeneration, WhisperProcessor

        processor = WhisperProcessor.from_pretrained(str(path))
        model = WhisperForConditionalGeneration.from_pretrained(str(path)).eval()
        window = 30 * ASR_SAMPLE_RATE  # whisper's encoder sees 30 s; longer audio is cut into windows

        def decode(x: np.ndarray) -> str:
            texts = []
            for start in range(0, len(x), window):
                features = processor(x[start:start + window], sampling_rate=ASR_SAMPLE_RATE,
                                     return_tensors="pt").input_features
                with torch.no_grad():
                    ids = model.generate(features, language=self.language, task="transcribe")
                texts.append(processor.batch_decode(ids, skip_special_tokens=True)[0])
            return " ".join(texts)

        return decode


def transcribe(wav: np.ndarray, sample_rate: int, backend: str = "pocketsphinx",
               model_path: str | None = None) -> str:
    """One-off transcription (loads the model each call; keep a `Transcriber` for many clips).
    Audio at any rate is resampled to 16 kHz. Returns normalised text."""
    return Transcriber(backend, model_path)(wav, sample_rate)


# ---------------------------------------------------------------------------------------------------
# Speech check


@dataclass(frozen=True)
class SpeechThresholds:
    """What `is_speech` asks for. Voicing: a frame is voiced when it is active, its normalised
    autocorrelation has a true peak (a local maximum, not the edge of a decaying low-pass correlation)
    above `min_periodicity` at a pitch lag of 60-400 Hz, and its zero-crossing rate is below
    `max_voiced_zcr`. Modulation: speech rises and falls with syllables; stationary noise does not."""
    active_floor_db: float = -35.0      # active frame: within this of the loudest frame ...
    active_abs_floor: float = 1e-3      # ... and above -60 dBFS RMS
    min_periodicity: float = 0.5
    max_voiced_zcr: float = 0.25        # zero crossings per sample; white noise sits near 0.5
    min_voiced_fraction: float = 0.25   # of active frames
    min_voiced_s: float = 0.25
    min_energy_std_db: float = 4.0      # std of active frames' log energy
    min_words: int = 1                  # recognised words (when a transcriber is given)


@dataclass
class SpeechEvidence:
    duration_s: float
    active_s: float
    voiced_s: float
    voiced_fraction: float
    energy_std_db: float
    zero_crossing_rate: float           # mean over active frames
    words: int | None                   # None when no ASR ran
    text: str | None

    def to_dict(self) -> dict:
        return asdict(self)


def _frames(x: np.ndarray, frame: int, hop: int) -> np.ndarray:
    n = 1 + (len(x) - frame) // hop if len(x) >= frame else 0
    idx = np.arange(frame)[None, :] + hop * np.arange(n)[:, None]
    return x[idx]


def _periodicity(frames: np.ndarray, sample_rate: int) -> np.ndarray:
    """Per frame: the highest normalised autocorrelation peak at a lag of 60-400 Hz that is a local
    maximum strictly inside the lag range (0 where there is none)."""
    lo, hi = int(sample_rate / 400), int(sample_rate / 60)
    f = frames - frames.mean(axis=1, keepdims=True)
    n = f.shape[1]
    spec = np.fft.rfft(f, 2 * n, axis=1)
    ac = np.fft.irfft(spec * np.conj(spec), axis=1)[:, : hi + 2]
    ac = ac / np.maximum(ac[:, :1], 1e-12)
    mid = ac[:, lo:hi + 1]
    is_peak = (mid > ac[:, lo - 1:hi]) & (mid >= ac[:, lo + 1:hi + 2])
    return np.where(is_peak, mid, 0.0).max(axis=1)


def speech_evidence(wav: np.ndarray, sample_rate: int, transcriber: Transcriber | None = None,
                    thresholds: SpeechThresholds = SpeechThresholds()) -> SpeechEvidence:
    """Measures what `is_speech` judges, on 16 kHz audio in 32 ms frames every 16 ms."""
    x = resample(np.asarray(wav, np.float32), sample_rate, ASR_SAMPLE_RATE).astype(np.float64)
    frames = _frames(x, 512, 256)
    hop_s = 256 / ASR_SAMPLE_RATE
    rms = np.sqrt(np.mean(frames ** 2, axis=1)) if len(frames) else np.zeros(0)
    peak = rms.max() if len(rms) else 0.0
    active = rms > max(peak * 10 ** (thresholds.active_floor_db / 20), thresholds.active_abs_floor)
    n_active = int(active.sum())
    if n_active == 0:
        return SpeechEvidence(len(x) / ASR_SAMPLE_RATE, 0.0, 0.0, 0.0, 0.0, 0.0,
                              0 if transcriber else None, "" if transcriber else None)
    act = frames[active]
    zcr = np.mean(np.abs(np.diff(np.sign(act), axis=1)) > 0, axis=1)
    voiced = (_periodicity(act, ASR_SAMPLE_RATE) > thresholds.min_periodicity) & (zcr < thresholds.max_voiced_zcr)
    energy_db = 20 * np.log10(rms[active])
    text = transcriber(wav, sample_rate) if transcriber is not None else None
    return SpeechEvidence(
        duration_s=len(x) / ASR_SAMPLE_RATE,
        active_s=n_active * hop_s,
        voiced_s=float(voiced.sum()) * hop_s,
        voiced_fraction=float(voiced.mean()),
        energy_std_db=float(energy_db.std()),
        zero_crossing_rate=float(zcr.mean()),
        words=len(text.split()) if text is not None else None,
        text=text,
    )


def judge_speech(ev: SpeechEvidence, thresholds: SpeechThresholds = SpeechThresholds()) -> bool:
    acoustic = (ev.voiced_fraction >= thresholds.min_voiced_fraction
                and ev.voiced_s >= thresholds.min_voiced_s
                and ev.energy_std_db >= thresholds.min_energy_std_db)
    return acoustic and (ev.words is None or ev.words >= thresholds.min_words)


def check_speech(wav: np.ndarray, sample_rate: int, transcriber: Transcriber | None,
                 thresholds: SpeechThresholds = SpeechThresholds()) -> tuple[bool, SpeechEvidence]:
    """`is_speech` with its evidence. ASR (~1x real time) runs only when the acoustic half passes,
    so rejected audio reports `words=None`. `transcriber=None` checks the acoustic half only."""
    ev = speech_evidence(wav, sample_rate, None, thresholds)
    if not judge_speech(ev, thresholds) or transcriber is None:
        return judge_speech(ev, thresholds), ev
    ev.text = transcriber(wav, sample_rate)
    ev.words = len(ev.text.split())
    return judge_speech(ev, thresholds), ev


def is_speech(wav: np.ndarray, sample_rate: int, transcriber: Transcriber | None = None,
              thresholds: SpeechThresholds = SpeechThresholds(), use_asr: bool = True) -> bool:
    """True when the audio holds speech: enough pitch-periodic, low-ZCR frames, syllable-like energy
    modulation, and at least `min_words` words recognised by `transcriber` (a pocketsphinx one is
    loaded when none is given). Loudness alone never counts. `use_asr=False` checks the acoustic half
    only."""
    if use_asr and transcriber is None:
        transcriber = Transcriber("pocketsphinx")
    return check_speech(wav, sample_rate, transcriber if use_asr else None, thresholds)[0]
