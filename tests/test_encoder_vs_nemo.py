"""Cross-check against NVIDIA's own code (nemo-toolkit 3.0.0, spec 12) at tiny size on the CPU: NeMo's
mel preprocessor vs our "nemo3" front end, and NeMo's ConformerEncoder with our weights vs our offline
encoder. Test-time only: scripts/test.sh runs it in .venv-nemo (nemo-toolkit and its ASR needs)."""
import pytest
import torch

nemo_asr = pytest.importorskip("nemo.collections.asr.modules", reason="nemo-toolkit==3.0.0 not installed")

from nemo_duplex.models.config import FrontendConfig, tiny_config  # noqa: E402
from nemo_duplex.models.encoder import Perception  # noqa: E402

FRAME = 1280


def build_pair(seed=0):
    cfg = tiny_config().encoder
    ours = Perception(FrontendConfig(variant="nemo3"), cfg)
    ours.init_weights(torch.Generator().manual_seed(seed))
    ours.eval()
    nemo_pre = nemo_asr.AudioToMelSpectrogramPreprocessor(
        sample_rate=16000, window_size=0.025, window_stride=0.01, window="hann", normalize="NA", n_fft=512,
        preemph=0.97, features=128, lowfreq=0, highfreq=None, log=True, log_zero_guard_type="add",
        log_zero_guard_value=2 ** -24, dither=0.0, pad_to=0, frame_splicing=1, mag_power=2.0, mel_norm="slaney")
    nemo_enc = nemo_asr.ConformerEncoder(
        feat_in=128, n_layers=cfg.n_layers, d_model=cfg.d_model, feat_out=-1, causal_downsampling=True,
        subsampling="dw_striding", subsampling_factor=8, subsampling_conv_channels=cfg.subsampling_conv_channels,
        ff_expansion_factor=cfg.ff_expansion_factor, self_attention_model="rel_pos", n_heads=cfg.n_heads,
        att_context_size=[cfg.att_context_left, cfg.att_context_right], att_context_style="chunked_limited",
        xscaling=False, untie_biases=True, conv_kernel_size=cfg.conv_kernel_size, conv_norm_type="layer_norm",
        conv_context_size="causal", use_bias=False, dropout=0.0, dropout_pre_encoder=0.0, dropout_emb=0.0,
        dropout_att=0.0)
    # NeMo builds fb with librosa (slaney) and the Hann(400, periodic=False) window itself: ours must agree.
    torch.testing.assert_close(ours.preprocessor.featurizer.fb, nemo_pre.featurizer.fb, atol=0, rtol=0)
    torch.testing.assert_close(ours.preprocessor.featurizer.window, nemo_pre.featurizer.window, atol=0, rtol=0)
    # Same checkpoint keys (spec 6.3): loading must be strict in both directions.
    nemo_pre.load_state_dict(ours.preprocessor.state_dict(), strict=True)
    nemo_enc.load_state_dict(ours.encoder.state_dict(), strict=True)
    return ours, nemo_pre.eval(), nemo_enc.eval()


@torch.no_grad()
def test_tiny_encoder_matches_nemo(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ours, nemo_pre, nemo_enc = build_pair()
    g = torch.Generator().manual_seed(1)
    lengths = [30 * FRAME + 500, 80 * FRAME]  # a batch with padding; longer than the 70-frame window
    audio = torch.zeros(2, max(lengths))
    for i, n in enumerate(lengths):
        audio[i, :n] = 0.2 * torch.randn(n, generator=g)
    lengths = torch.tensor(lengths)

    mel, mel_len = ours.preprocessor(audio, lengths)
    nemo_mel, nemo_mel_len = nemo_pre(input_signal=audio, length=lengths)
    assert torch.equal(mel_len, nemo_mel_len)
    t = mel.shape[-1]
    torch.testing.assert_close(mel, nemo_mel[..., :t], atol=1e-5, rtol=0)  # same ops, fp32

    enc, enc_len = ours.encoder(mel, mel_len)
    nemo_out, nemo_len = nemo_enc(audio_signal=mel, length=mel_len)
    assert torch.equal(enc_len, nemo_len)
    nemo_out = nemo_out.transpose(1, 2)  # NeMo returns [B, d, T]
    for b, n in enumerate(enc_len.tolist()):
        want = nemo_out[b, :n]
        rel = (enc[b, :n] - want).abs().max() / want.abs().max()
        assert rel < 1e-5, f"row {b}: max rel diff {rel:.2e}"  # fp32, same algorithm
