"""Mel front end (spec 2.1, 12.3): filterbank and window, offline mel against a float64 numpy
re-derivation, valid lengths of both variants, and the streaming columns against the offline ones."""
import math

import numpy as np
import pytest
import torch

from nemo_duplex.models.config import FrontendConfig
from nemo_duplex.models.frontend import MelFrontend, slaney_mel_filterbank

HOP, FRAME = 160, 1280


def assert_mel_close(got: torch.Tensor, want: torch.Tensor, tol: float):
    """Log-mel [..., n_mels, T] compared as mel power relative to the column's strongest band: fp32
    DFT rounding scales with the frame's energy, so a near-silent band (preemphasis removes the lowest
    frequencies) can be off by more than tol in ln while the spectrum is right to tol."""
    p_got, p_want = got.double().exp(), want.double().exp()
    scale = p_want.amax(dim=-2, keepdim=True)
    err = ((p_got - p_want).abs() / scale).max().item()
    assert err <= tol, f"mel power differs by {err:.2e} of the column maximum (tol {tol:.0e})"


def test_buffers_keys_and_shapes():
    with torch.device("meta"):
        fe = MelFrontend(FrontendConfig())
    assert {k: tuple(v.shape) for k, v in fe.state_dict().items()} == {
        "featurizer.fb": (1, 128, 257), "featurizer.window": (400,)}


def test_window_is_symmetric_hann():
    w = MelFrontend(FrontendConfig()).featurizer.window.double()
    n = torch.arange(400, dtype=torch.float64)
    torch.testing.assert_close(w, 0.5 - 0.5 * torch.cos(2 * math.pi * n / 399), atol=3e-7, rtol=0)  # fp32 table


def test_slaney_filterbank_against_closed_form():
    # Independent derivation: slaney mel points, triangle between neighbours, area-normalised by 2/width.
    def mel_to_hz(m):
        return 200.0 / 3 * m if m < 15 else 1000.0 * math.exp(math.log(6.4) / 27 * (m - 15))

    def hz_to_mel(f):
        return f * 3 / 200.0 if f < 1000 else 15 + math.log(f / 1000.0) / (math.log(6.4) / 27)

    fb = slaney_mel_filterbank(16000, 512, 128)
    assert fb.shape == (128, 257) and fb.dtype == np.float32
    top = hz_to_mel(8000.0)
    points = [mel_to_hz(top * i / 129) for i in range(130)]
    for m in (0, 1, 20, 64, 100, 127):
        lo, mid, hi = points[m], points[m + 1], points[m + 2]
        for b in range(257):
            f = b * 8000.0 / 256
            tri = max(0.0, min((f - lo) / (mid - lo), (hi - f) / (hi - mid)))
            assert fb[m, b] == pytest.approx(tri * 2.0 / (hi - lo), rel=1e-6, abs=1e-12)  # fp32 storage
    assert hz_to_mel(1000.0) == pytest.approx(15.0)  # the scale is linear below 1 kHz


def numpy_log_mel(audio: np.ndarray, fb: np.ndarray, window: np.ndarray, variant: str) -> np.ndarray:
    """float64 re-derivation: preemphasis, centre padding, frames, Hann(400) in 512, |rfft|^2, fb, ln."""
    y = np.concatenate([audio[:1], audio[1:] - 0.97 * audio[:-1]])
    y = np.pad(y, 256, mode="reflect" if variant == "release" else "constant")
    win = np.pad(window, 56)
    cols = 1 + (len(y) - 512) // HOP
    frames = np.stack([y[c * HOP:c * HOP + 512] * win for c in range(cols)])
    power = np.abs(np.fft.rfft(frames, axis=-1)) ** 2
    return np.log(power @ fb.T + 2.0 ** -24).T  # [n_mels, cols]


@pytest.mark.parametrize("variant", ["release", "nemo3"])
def test_offline_mel_against_numpy(variant):
    fe = MelFrontend(FrontendConfig(variant=variant))
    g = torch.Generator().manual_seed(0)
    n = 5 * FRAME + 333
    audio = 0.1 * torch.randn(1, n, generator=g)
    mel, mel_len = fe(audio, torch.tensor([n]))
    valid = n // HOP + (1 if variant == "release" else 0)
    assert mel.shape == (1, 128, n // HOP + 1) and mel.dtype == torch.float32
    assert mel_len.tolist() == [valid]
    want = numpy_log_mel(audio[0].double().numpy(), fe.featurizer.fb[0].double().numpy(),
                         fe.featurizer.window.double().numpy(), variant)
    assert_mel_close(mel[0, :, :valid], torch.from_numpy(want[:, :valid]), tol=1e-5)  # fp32 STFT vs float64
    assert mel[0, :, valid:].eq(0).all()


@pytest.mark.parametrize("variant", ["release", "nemo3"])
def test_batched_rows_match_single_rows(variant):
    fe = MelFrontend(FrontendConfig(variant=variant))
    g = torch.Generator().manual_seed(1)
    lengths = [4000, 2500, 3333]
    audio = torch.zeros(3, 4000)
    for i, n in enumerate(lengths):
        audio[i, :n] = 0.2 * torch.randn(n, generator=g)
    audio[1, 2500:] = 5.0  # garbage past a row's length must not matter
    mel, mel_len = fe(audio, torch.tensor(lengths))
    for i, n in enumerate(lengths):
        alone, alone_len = fe(audio[i:i + 1, :n], torch.tensor([n]))
        assert mel_len[i] == alone_len[0]
        # Columns whose window lies inside the row's audio are identical; the last ones see zeros past
        # the row's end instead of its own reflection (as in NeMo's batched featurizer).
        inside = (n - 256) // HOP + 1
        torch.testing.assert_close(mel[i, :, :inside], alone[0, :, :inside], atol=1e-5, rtol=0)
        assert mel[i, :, mel_len[i]:].eq(0).all()


@pytest.mark.parametrize("variant", ["release", "nemo3"])
def test_streaming_columns_equal_offline(variant):
    fe = MelFrontend(FrontendConfig(variant=variant))
    g = torch.Generator().manual_seed(2)
    chunks = 6
    audio = 0.1 * torch.randn(2, chunks * FRAME, generator=g)
    audio[1] *= 10.0
    offline, _ = fe(audio, torch.tensor([chunks * FRAME] * 2))
    tail_len = fe.stream_tail_samples(8)
    assert tail_len == 7 * HOP + 256 + 1
    tail = torch.zeros(2, tail_len)
    for k in range(chunks):
        chunk = audio[:, k * FRAME:(k + 1) * FRAME]
        cols = fe.stream_columns(tail, chunk, torch.tensor([k, k]), 8)
        tail = torch.cat([tail, chunk], dim=1)[:, -tail_len:]
        first = 8 * k - 7
        keep = slice(max(0, -first), 8)  # negative columns are garbage by contract
        want = offline[:, :, first + keep.start:8 * k + 1]
        assert_mel_close(cols[:, :, keep], want, tol=1e-5)  # DFT as a basis matmul vs torch.stft's FFT, fp32


def test_variants_differ_only_at_the_edges():
    g = torch.Generator().manual_seed(3)
    audio = 0.1 * torch.randn(1, 3 * FRAME, generator=g)
    n = torch.tensor([3 * FRAME])
    rel, rel_len = MelFrontend(FrontendConfig(variant="release"))(audio, n)
    nm3, nm3_len = MelFrontend(FrontendConfig(variant="nemo3"))(audio, n)
    assert rel_len.item() == nm3_len.item() + 1
    assert (rel[0, :, 0] - nm3[0, :, 0]).abs().max() > 1e-2  # column 0: reflect vs zero padding
    torch.testing.assert_close(rel[0, :, 2:-2], nm3[0, :, 2:-2], atol=0, rtol=0)
    assert nm3[0, :, -1].eq(0).all()
