"""The WER pipeline (eval/wer.py, eval/audio.py) and the espeak clips (eval/clips/make_clips.py).

Needs Debian's espeak-ng (apt-get install espeak-ng); without it the tests fail, they do not skip.
pocketsphinx is slow (~0.3x real time here after pruning), so the clips are
made once per module and the long turn is left out.
"""
import wave

import numpy as np
import pytest

from eval.audio import read_wav, resample, write_wav
from eval.clips.make_clips import KINDS, load_clip_config, load_clips, make_clips
from eval.wer import Transcriber, check_speech, is_speech, normalize_text, transcribe, wer

SPEECH = ["question_capital", "question_spider", "interruption", "tool_weather"]
NON_SPEECH = ["silence", "noise_white", "noise_hiss"]
TRAILING_S = 1.0
# Measured on these four clips (espeak-ng 1.51, pocketsphinx 5.1.1): corpus WER 0.21, worst clip 0.57.
MAX_CORPUS_WER = 0.5
MAX_CLIP_WER = 0.8


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return {c.name: c for c in make_clips(tmp_path_factory.mktemp("clips"), names=SPEECH + NON_SPEECH,
                                          trailing_silence_s=TRAILING_S)}


@pytest.fixture(scope="module")
def asr():
    return Transcriber("pocketsphinx")


@pytest.fixture
def rng():
    return np.random.default_rng()  # fresh inputs every run


# --- resampler -------------------------------------------------------------------------------------

def test_resample_passband_matches_exact_sine(rng):
    # 22.05 kHz (agent audio) -> 16 kHz (ASR). Measured max error 7e-6 up to 6 kHz; bound 1e-4.
    f, phase = rng.uniform(100, 6000), rng.uniform(0, 2 * np.pi)
    x = 0.5 * np.sin(2 * np.pi * f * np.arange(22050 * 2) / 22050 + phase)
    y = resample(x, 22050, 16000)
    assert len(y) == 32000
    exact = 0.5 * np.sin(2 * np.pi * f * np.arange(len(y)) / 16000 + phase)
    edge = 100  # the signal is zero outside its ends, so the first/last filter half-widths differ
    np.testing.assert_allclose(y[edge:-edge], exact[edge:-edge], atol=1e-4, rtol=0)


def test_resample_rejects_above_output_nyquist(rng):
    # A tone above 8 kHz must vanish, not alias. Measured > 90 dB down; bound 80 dB.
    f = rng.uniform(8500, 11000)
    x = 0.5 * np.sin(2 * np.pi * f * np.arange(22050 * 2) / 22050)
    y = resample(x, 22050, 16000)[200:-200]
    atten_db = 20 * np.log10(np.sqrt(np.mean(y ** 2)) / np.sqrt(np.mean(x ** 2)))
    assert atten_db < -80, atten_db


def test_resample_up_and_identity(rng):
    x = rng.standard_normal(1000).astype(np.float32)
    np.testing.assert_array_equal(resample(x, 16000, 16000), x)
    f = rng.uniform(100, 6000)
    t_in = np.arange(16000) / 16000
    y = resample(np.sin(2 * np.pi * f * t_in), 16000, 22050)
    assert len(y) == 22050
    exact = np.sin(2 * np.pi * f * np.arange(len(y)) / 22050)
    np.testing.assert_allclose(y[200:-200], exact[200:-200], atol=1e-4, rtol=0)


# --- WER scoring -----------------------------------------------------------------------------------

def test_normalize_text():
    assert normalize_text("What's the WEATHER, in Paris?!") == "what's the weather in paris"
    assert normalize_text("well-known  \u2018quote\u2019 word(2)") == "well known quote word"


def test_wer_counts_and_corpus_weighting():
    assert wer("What is the capital of France?", "what is the capital of france") == 0.0
    assert wer("a b c d", "a x c") == pytest.approx(2 / 4)  # one substitution, one deletion
    # A list is one corpus: 1 error over 5 reference words, not the mean of per-clip rates (0.5).
    assert wer(["a b c d", "e"], ["a b c d", "x"]) == pytest.approx(1 / 5)
    assert wer("", "") == 0.0
    with pytest.raises(ValueError):
        wer("", "some words")


# --- clips -----------------------------------------------------------------------------------------

def test_clip_config_covers_every_kind():
    cfg = load_clip_config()
    kinds = {item.kind for item in cfg.items}
    assert {"question", "long_turn", "interruption", "silence", "tool_request"} <= kinds
    assert kinds <= set(KINDS)
    assert cfg.sample_rate == 16000 and cfg.trailing_silence_s > 0


def test_clips_are_16k_mono_pcm16_with_trailing_silence(clips):
    for c in clips.values():
        with wave.open(c.path, "rb") as f:
            assert (f.getframerate(), f.getnchannels(), f.getsampwidth()) == (16000, 1, 2), c.name
        x, sr = c.load()
        tail = x[-int(TRAILING_S * sr):]
        assert np.all(tail == 0), f"{c.name}: the last {TRAILING_S} s must be silence"
        assert np.any(x[: -int(TRAILING_S * sr)] != 0) or c.kind == "silence", c.name
    inter = clips["interruption"]
    says = [s for s in inter.segments if s.kind == "say"]
    assert len(says) == 2 and says[1].start_s - says[0].end_s == pytest.approx(2.0, abs=1e-3)
    assert inter.speech_end_s == pytest.approx(says[1].end_s)


def test_clips_are_deterministic(clips, tmp_path):
    again = {c.name: c for c in make_clips(tmp_path, names=["question_capital", "noise_white"],
                                           trailing_silence_s=TRAILING_S)}
    for name in again:
        assert again[name].sha256 == clips[name].sha256, name


def test_load_clips_from_folder(clips, tmp_path):
    x, sr = clips["question_capital"].load()
    write_wav(tmp_path / "mine.wav", x, sr)
    (tmp_path / "mine.txt").write_text("What is the capital of France?\n")
    write_wav(tmp_path / "other.wav", x[: sr // 2], sr)
    loaded = {c.name: c for c in load_clips(tmp_path)}
    assert loaded["mine"].text == "What is the capital of France?" and loaded["other"].text is None
    assert loaded["mine"].duration_s == pytest.approx(len(x) / sr)
    # a folder made by make_clips round-trips through its clips.json
    made = load_clips(clips["silence"].path.rsplit("/", 1)[0])
    assert {c.name for c in made} == set(clips) and all(c.kind for c in made)


# --- ASR and the speech check ----------------------------------------------------------------------

def test_wer_pipeline_on_espeak_clips(clips, asr):
    refs, hyps = [], []
    for name in SPEECH:
        x, sr = clips[name].load()
        ok, ev = check_speech(x, sr, asr)
        assert ok, f"{name} not detected as speech: {ev}"
        assert wer(clips[name].text, ev.text) <= MAX_CLIP_WER, (name, ev.text)
        refs.append(clips[name].text)
        hyps.append(ev.text)
    assert wer(refs, hyps) <= MAX_CORPUS_WER, list(zip(refs, hyps))


def test_transcribe_agent_rate_audio(clips):
    # The agent speaks at 22.05 kHz: transcribe() resamples inside.
    x, sr = clips["question_capital"].load()
    x22 = resample(x, sr, 22050)
    assert wer(clips["question_capital"].text, transcribe(x22, 22050)) <= MAX_CLIP_WER


def _noises(rng, rms: float, n: int):
    white = rng.standard_normal(n)
    hiss = np.diff(rng.standard_normal(n + 1))  # rising towards Nyquist
    spec = np.fft.rfft(rng.standard_normal(n))
    spec[1:] /= np.sqrt(np.arange(1, len(spec)))
    spec[0] = 0
    pink = np.fft.irfft(spec, n)
    brown = np.cumsum(rng.standard_normal(n))
    brown -= np.convolve(brown, np.ones(801) / 801, "same")  # keep it zero-mean
    out = {k: (v * rms / np.sqrt(np.mean(v ** 2))).astype(np.float32)
           for k, v in dict(white=white, hiss=hiss, pink=pink, brown=brown).items()}
    t = np.arange(n) / 16000
    out["tone"] = (rms * np.sqrt(2) * np.sin(2 * np.pi * rng.uniform(100, 300) * t)).astype(np.float32)
    out["silence"] = np.zeros(n, np.float32)
    return out


def test_noise_is_not_speech(clips, asr, rng):
    x, sr = clips["question_capital"].load()
    speech_rms = float(np.sqrt(np.mean(x[np.abs(x) > 0.01] ** 2)))
    for name, noise in _noises(rng, speech_rms, 3 * 16000).items():
        if name != "silence":  # an RMS heuristic would call these voiced: as loud as the speech
            assert np.sqrt(np.mean(noise ** 2)) >= 0.99 * speech_rms
        assert not is_speech(noise, 16000, asr), name
    for name in NON_SPEECH:
        y, sr = clips[name].load()
        ok, ev = check_speech(y, sr, asr)
        assert not ok, (name, ev)


def test_whisper_backend_needs_a_local_model(tmp_path):
    with pytest.raises(ValueError, match="model_path"):
        Transcriber("whisper")
    with pytest.raises(FileNotFoundError):
        Transcriber("whisper", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not a whisper model"):
        Transcriber("whisper", str(tmp_path))
    with pytest.raises(ValueError, match="unknown ASR backend"):
        Transcriber("kaldi")


def test_read_wav_round_trip(rng, tmp_path):
    x = (rng.uniform(-0.9, 0.9, 1600)).astype(np.float32)
    write_wav(tmp_path / "x.wav", x, 16000)
    y, sr = read_wav(tmp_path / "x.wav")
    assert sr == 16000
    np.testing.assert_allclose(y, x, atol=0.5 / 32768 + 1e-7)  # PCM16 rounding
