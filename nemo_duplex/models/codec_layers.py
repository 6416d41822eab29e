"""The RVQ codec's networks (MODEL_SPEC sections 5.1, 5.2, 5.5), under their checkpoint keys
(`tts_model.audio_codec.` + `encoder.layers.N`, `decoder.layers.N`, `prvq.mus_list.i`,
`prvq._variance_list.i.variance`, spec 6.3): the causal ConvNeXt block both stacks are built of, the encoder
(wav -> latent), the decoder (latent -> iSTFT head input, one-shot and one frame per call) and the residual
vector quantiser. The decoder's GEMMs run as the `Gemm` kind the codec made at load (codec.py: fp32, or
fp32-accurate on tensor cores), passed in by RVQCodec.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nemo_duplex.models.codec import IEEE, Gemm, channels_last_weight
from nemo_duplex.models.config import CodecConfig
from ops.codebook_sum import codebook_sum
from ops.dwconv_layernorm import dwconv_layer_norm
from ops.istft_step import hann_window

# ----------------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------------

def _normal_(param: torch.Tensor, generator: torch.Generator, std: float, mean: float = 0.0) -> None:
    """Draw on the CPU with the generator (device independent), then copy to the parameter's device."""
    with torch.no_grad():
        param.copy_(torch.randn(param.shape, generator=generator, device=generator.device) * std + mean)


class ConvNeXtBlock(nn.Module):
    """Causal ConvNeXt1d (spec 5.2): x + pwconv2(GELU(pwconv1(LN_c(dwconv(leftpad(x)))))).
    dwconv is depthwise with kernel k and a (k-1)-frame causal left pad; LayerNorm over channels with
    eps 1e-6; exact (erf) GELU; pwconv1/pwconv2 are k=1 convolutions (applied as linears)."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.history = kernel_size - 1  # input frames of left context each output needs
        self.dwconv = nn.Conv1d(channels, channels, kernel_size, groups=channels)
        self.norm = nn.LayerNorm(channels, eps=1e-6)
        self.pwconv1 = nn.Conv1d(channels, 4 * channels, 1)
        self.pwconv2 = nn.Conv1d(4 * channels, channels, 1)
        # split_weight of pwconv1/pwconv2's weight for `step` (decoder blocks only): derived, so not in the
        # state_dict; empty unless RVQCodec.presplit_weights built them.
        self.register_buffer("pwconv1_split", torch.empty(0), persistent=False)
        self.register_buffer("pwconv2_split", torch.empty(0), persistent=False)

    def forward(self, x: torch.Tensor, gemm: Gemm = IEEE) -> torch.Tensor:
        """x [B, C, L] from the start of the signal: zeros before it (the causal pad)."""
        return self.forward_padded(F.pad(x, (self.history, 0)), gemm)

    def forward_padded(self, padded: torch.Tensor, gemm: Gemm = IEEE) -> torch.Tensor:
        """padded [B, C, history + L]: the input with its `history` preceding frames -> [B, C, L].
        `gemm`: the kind the k=1 convs run as."""
        residual = padded[:, :, self.history:]
        y = self.dwconv(padded).transpose(1, 2)  # [B, L, C]: LayerNorm and k=1 convs over channels
        y = self.norm(y)
        y = gemm(y, self.pwconv1.weight[:, :, 0], self.pwconv1.bias, gelu=True)
        y = gemm(y, self.pwconv2.weight[:, :, 0], self.pwconv2.bias)
        return residual + y.transpose(1, 2)

    def step(self, x: torch.Tensor, history: torch.Tensor, slots: torch.Tensor, gemm: Gemm) -> torch.Tensor:
        """Streaming, channels-last: x [B, L, C] new frames, history [S, k-1, C] the last k-1 input frames of
        each slot (rows `slots` precede x, then are moved on in place) -> [B, L, C]. The conv and the
        LayerNorm are one kernel reading the history where it is (ops/dwconv_layernorm.py); the k=1 convs
        are `gemm.mlp`, the skip added in the second GEMM's epilogue. Same sums as `forward_padded` up to
        their order. The k=1 convs take their weights' pre-split halves where built
        (RVQCodec.presplit_weights)."""
        y = dwconv_layer_norm(x, history, slots, self.dwconv.weight, self.dwconv.bias, self.norm.weight,
                              self.norm.bias, self.norm.eps)
        # after the read above: the last k-1 input frames (fewer new frames than that: some old ones stay)
        if x.shape[1] >= self.history:
            history.index_copy_(0, slots, x[:, x.shape[1] - self.history:])
        else:
            history.index_copy_(0, slots, torch.cat([history.index_select(0, slots), x], 1)[:, -self.history:])
        return gemm.mlp(y, self.pwconv1.weight[:, :, 0], self.pwconv1.bias, self.pwconv2.weight[:, :, 0],
                        self.pwconv2.bias, residual=x, split1=_built(self.pwconv1_split),
                        split2=_built(self.pwconv2_split))

    def init_weights(self, generator: torch.Generator) -> None:
        channels, kernel = self.dwconv.weight.shape[0], self.dwconv.weight.shape[-1]
        _normal_(self.dwconv.weight, generator, kernel ** -0.5)
        _normal_(self.dwconv.bias, generator, 0.1)
        _normal_(self.norm.weight, generator, 0.1, mean=1.0)
        _normal_(self.norm.bias, generator, 0.1)
        _normal_(self.pwconv1.weight, generator, channels ** -0.5)
        _normal_(self.pwconv1.bias, generator, 0.1)
        # Small residual branch: nine blocks in a row must not blow the activations up.
        _normal_(self.pwconv2.weight, generator, 0.5 * (4 * channels) ** -0.5)
        _normal_(self.pwconv2.bias, generator, 0.05)


def _built(table: torch.Tensor) -> torch.Tensor | None:
    """A derived buffer, or None while it is empty (not built)."""
    return table if table.numel() else None


def gemm_weight(layer: nn.Module) -> torch.Tensor:
    """A decoder GEMM layer's weight [N, K] in the row order `Latent2Wav.step` multiplies by: a k=1
    Conv1d's [N, K, 1] as a view, a ConvTranspose1d's reordered channels-last (a copy)."""
    if isinstance(layer, nn.ConvTranspose1d):
        return channels_last_weight(layer.weight)
    return layer.weight[:, :, 0]


def _init_conv(conv: nn.Module, generator: torch.Generator) -> None:
    """Unit-gain init for a bias-free (transposed) convolution: std 1/sqrt(fan-in). A transposed conv
    with kernel == stride sums over input channels only; a strided conv over channels x kernel."""
    if isinstance(conv, nn.ConvTranspose1d):
        fan_in = conv.in_channels
    else:
        fan_in = conv.in_channels * conv.kernel_size[0]
    _normal_(conv.weight, generator, fan_in ** -0.5)


# ----------------------------------------------------------------------------------------------------
# Encoder, decoder, quantiser
# ----------------------------------------------------------------------------------------------------

class Wav2Latent(nn.Module):
    """Encoder (spec 5.5): STFT (16/4, periodic Hann, zero pad 6 | 6, center=False) -> [Re | Im] 18 ch
    -> Conv1d k1 -> per stage: ConvNeXt x num_blocks, strided Conv1d (rates 7, 7, 9). No biases outside
    the ConvNeXt blocks."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.n_fft, self.hop = cfg.n_fft, cfg.hop_length
        widths = [cfg.base_hidden_size * m for m in cfg.channel_mult]
        layers: list[nn.Module] = [nn.Conv1d(cfg.n_fft + 2, widths[0], 1, bias=False)]
        for stage, (width, rate) in enumerate(zip(widths, cfg.rates)):
            layers += [ConvNeXtBlock(width, cfg.kernel_size) for _ in range(cfg.num_blocks)]
            next_width = widths[stage + 1] if stage + 1 < len(widths) else cfg.latent_size
            layers.append(nn.Conv1d(width, next_width, rate, stride=rate, bias=False))
        self.layers = nn.ModuleList(layers)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        """wav [B, N] (N a multiple of hop * prod(rates)) -> latent [B, latent, N / 1764]."""
        pad = (self.n_fft - self.hop) // 2
        spec = torch.stft(F.pad(wav, (pad, pad)), self.n_fft, hop_length=self.hop, win_length=self.n_fft,
                          window=hann_window(self.n_fft, wav.device), center=False, return_complex=True)
        x = torch.cat([spec.real, spec.imag], dim=1)  # [B, 18, N / hop]
        for layer in self.layers:
            x = layer(x)
        return x

    def init_weights(self, generator: torch.Generator) -> None:
        for layer in self.layers:
            layer.init_weights(generator) if isinstance(layer, ConvNeXtBlock) else _init_conv(layer, generator)


class Latent2Wav(nn.Module):
    """Decoder (spec 5.2): per stage (rates 9, 7, 7; widths 4C, 2C, C) a ConvTranspose1d with kernel ==
    stride, then ConvNeXt x num_blocks; a final Conv1d k1 to n_fft + 2 channels (the iSTFT head input)."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        widths = [cfg.base_hidden_size * m for m in reversed(cfg.channel_mult)]
        layers: list[nn.Module] = []
        width_in = cfg.latent_size
        for width, rate in zip(widths, reversed(cfg.rates)):
            layers.append(nn.ConvTranspose1d(width_in, width, rate, stride=rate, bias=False))
            layers += [ConvNeXtBlock(width, cfg.kernel_size) for _ in range(cfg.num_blocks)]
            width_in = width
        layers.append(nn.Conv1d(width_in, cfg.n_fft + 2, 1, bias=False))
        self.layers = nn.ModuleList(layers)
        # split_{i}: the kind's split_weight(gemm_weight(layers[i])) for the upsampling layers and the final
        # conv in `step` (the ConvNeXt blocks hold their own); empty unless RVQCodec.presplit_weights built them.
        for i, layer in enumerate(layers):
            if not isinstance(layer, ConvNeXtBlock):
                self.register_buffer(f"split_{i}", torch.empty(0), persistent=False)

    def forward(self, latent: torch.Tensor, gemm: Gemm = IEEE) -> torch.Tensor:
        """latent [B, latent, T] -> iSTFT head input [B, n_fft + 2, 441 T]; `gemm`: the GEMMs' kind."""
        x = latent
        for layer in self.layers:
            x = layer(x, gemm) if isinstance(layer, ConvNeXtBlock) else self._linear_layer(layer, x, gemm)
        return x

    @staticmethod
    def _linear_layer(layer: nn.Module, x: torch.Tensor, gemm: Gemm) -> torch.Tensor:
        """The upsampling ConvTranspose1d layers and the final k=1 Conv1d, as matmuls (no cuDNN dgrad
        kernels, and the same GEMM numerics as the ConvNeXt blocks)."""
        if isinstance(layer, nn.ConvTranspose1d):
            return gemm.upsample(x, layer.weight)
        return gemm(x.transpose(1, 2), layer.weight[:, :, 0], None).transpose(1, 2)

    def convnext_blocks(self) -> list[ConvNeXtBlock]:
        return [layer for layer in self.layers if isinstance(layer, ConvNeXtBlock)]

    def step_gemms(self) -> list[tuple[nn.Module, str, nn.Module]]:
        """(holder, buffer name, layer) for every GEMM of `step`, in order: the buffer of `holder` that keeps
        the split of gemm_weight(layer) (RVQCodec.presplit_weights)."""
        gemms: list[tuple[nn.Module, str, nn.Module]] = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, ConvNeXtBlock):
                gemms += [(layer, "pwconv1_split", layer.pwconv1), (layer, "pwconv2_split", layer.pwconv2)]
            else:
                gemms.append((self, f"split_{i}", layer))
        return gemms

    def step(self, latent: torch.Tensor, history: list[torch.Tensor], slots: torch.Tensor,
             gemm: Gemm = IEEE) -> torch.Tensor:
        """One code frame per row, channels-last throughout (every GEMM's rows are frames, so no transpose
        between layers): latent [B, 1, latent] -> head input [B, 441, n_fft + 2]. history[i] [S, k-1, C_i]
        holds the last k-1 input frames of ConvNeXt block i per slot; rows `slots` are read and then
        overwritten in place. `forward` (channels-first, one-shot) is the reference it is tested against.
        The GEMMs take the pre-split weights where built (RVQCodec.presplit_weights)."""
        x = latent
        block = 0
        for i, layer in enumerate(self.layers):
            if isinstance(layer, ConvNeXtBlock):
                x = layer.step(x, history[block], slots, gemm)
                block += 1
            elif isinstance(layer, nn.ConvTranspose1d):
                x = gemm.upsample_channels_last(x, layer.weight, split=_built(getattr(self, f"split_{i}")))
            else:
                x = gemm(x, layer.weight[:, :, 0], None, split=_built(getattr(self, f"split_{i}")))
        return x

    def init_weights(self, generator: torch.Generator) -> None:
        for layer in self.layers:
            layer.init_weights(generator) if isinstance(layer, ConvNeXtBlock) else _init_conv(layer, generator)


class CodebookVariance(nn.Module):
    """Holds the `variance` scalar of one codebook (`prvq._variance_list.i.variance`, training only)."""

    def __init__(self):
        super().__init__()
        self.variance = nn.Parameter(torch.ones(()))


class ResidualVQ(nn.Module):
    """Residual vector quantiser: `mus_list[i]` [codebook, latent] per quantiser (spec 5.1, 5.5)."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.mus_list = nn.ParameterList(
            [nn.Parameter(torch.empty(cfg.codebook_size, cfg.latent_size)) for _ in range(cfg.num_quantizers)])
        self._variance_list = nn.ModuleList([CodebookVariance() for _ in range(cfg.num_quantizers)])
        # The codebooks stacked [Q, codebook, latent], derived from mus_list, so not in the state_dict: built
        # on first use (`stacked`), emptied when a state_dict loads or the weights are drawn (64 MiB at full
        # size). It lets dequantize run as one kernel (ops/codebook_sum.py).
        self.register_buffer("mus_stacked", torch.empty(0), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.clear_stacked())

    def clear_stacked(self) -> None:
        self.mus_stacked = torch.empty(0, device=self.mus_list[0].device)

    def stacked(self) -> torch.Tensor:
        if self.mus_stacked.numel() == 0 or self.mus_stacked.device != self.mus_list[0].device \
                or self.mus_stacked.dtype != self.mus_list[0].dtype:
            with torch.no_grad():
                self.mus_stacked = torch.stack(list(self.mus_list))
        return self.mus_stacked

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [..., Q] -> sum_i mus_list[i][codes[..., i]], [..., latent], added in order i = 0..Q-1."""
        return codebook_sum(codes, self.stacked())

    def quantize(self, latent: torch.Tensor) -> torch.Tensor:
        """Greedy residual quantisation: latent [..., latent] -> codes [..., Q] int64; code i is the nearest
        codeword of codebook i to the residual left by codes 0..i-1."""
        residual = latent
        codes = []
        for mus in self.mus_list:
            # argmin |r - m|^2 = argmin (|m|^2 - 2 r.m): |r|^2 is the same for every codeword.
            distance = mus.square().sum(-1) - 2.0 * residual @ mus.T
            code = distance.argmin(-1)
            codes.append(code)
            residual = residual - F.embedding(code, mus)
        return torch.stack(codes, dim=-1)

    def init_weights(self, generator: torch.Generator) -> None:
        # Codebook i has std sqrt((1 - r) r^i): the sum of all 31 has unit variance, later codebooks refine.
        self.clear_stacked()
        ratio = 0.7
        for i, mus in enumerate(self.mus_list):
            _normal_(mus, generator, math.sqrt((1 - ratio) * ratio ** i))
        for entry in self._variance_list:
            with torch.no_grad():
                entry.variance.copy_(0.5 + torch.rand((), generator=generator, device=generator.device))

