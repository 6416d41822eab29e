"""`RVQCodec`, the RVQ-VAE audio codec under `tts_model.audio_codec.` (MODEL_SPEC section 5): one-shot decode
and encode, and the streaming decode with its per-call state; the iSTFT head (5.3) that turns the decoder's
output into samples. Its networks are in codec_layers.py, its GEMM numerics in codec.py (the kind made
once here, `gemm_kind`, when the codec is built, cast or moved, its weights presplit or `gemm` set).

Streaming (`decode_step`): the transposed convolutions have kernel == stride (no overlap, no state);
each causal ConvNeXt keeps its last 6 input frames; the overlap-add keeps the 12 samples (and their
window envelope) that the next frame's spectrogram frames still add to. The output is the one-shot
decode delayed by `stream_delay` = 6 samples, EXACTLY (up to fp32 rounding of a different summation
order), from the first sample on: the stream starts with 6 zeros, and `flush_step` returns the last 6
samples of the one-shot decode. NeMo's streaming wrapper (spec 5.4, 12.7) delays by 8 and differs
from one-shot at stream samples 8..13, because it divides the first frame by the full window envelope
where one-shot divides by the partial one; keeping the envelope's overlap-add tail in the state (zero
after reset) removes that difference and 6 is the smallest delay at which every output sample is final.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from nemo_duplex.models.codec import Gemm, codec_gemm, exact_fp32
from nemo_duplex.models.codec_layers import Latent2Wav, ResidualVQ, Wav2Latent, gemm_weight
from nemo_duplex.models.config import CodecConfig
from ops.istft_step import hann_window, istft_step, overlap_add, synthesis_frames, window_envelope


def replace_control_codes(codes: torch.Tensor, silence_codes: torch.Tensor, codebook_size: int) -> torch.Tensor:
    """codes [..., Q]: every code >= codebook_size (speech pad / eos / bos, spec 5.4) becomes the silence
    code of its codebook, silence_codes [Q]."""
    return torch.where(codes >= codebook_size, silence_codes.to(codes.dtype).expand_as(codes), codes)


# ----------------------------------------------------------------------------------------------------
# iSTFT head (spec 5.3)
# ----------------------------------------------------------------------------------------------------

# hann_window, synthesis_frames, overlap_add and window_envelope: ops/istft_step.py, whose reference they are


def istft(head: torch.Tensor, n_fft: int, hop: int, by_matmul: bool = False) -> torch.Tensor:
    """One-shot iSTFT: head [B, n_fft + 2, S] -> wav [B, hop*S]. Overlap-add, trim (n-hop)/2 samples at each
    end ("same" padding), divide by the window envelope trimmed the same way."""
    frames = synthesis_frames(head.transpose(1, 2), n_fft, by_matmul)
    trim = (n_fft - hop) // 2
    signal = overlap_add(frames, hop)[:, trim:-trim]
    envelope = window_envelope(frames.shape[1], n_fft, hop, head.device)[:, trim:-trim]
    return signal / envelope


# ----------------------------------------------------------------------------------------------------
# Codec
# ----------------------------------------------------------------------------------------------------

@dataclass
class CodecStreamState:
    """Per-call streaming state, one row per slot (the last row of a pool is the sink)."""
    convnext_history: list[torch.Tensor]  # per decoder ConvNeXt block (9): [S, 6, C_i] last input frames
    ola_tail: torch.Tensor       # [S, n_fft - hop] overlap-add samples the next frame still adds to
    envelope_tail: torch.Tensor  # [S, n_fft - hop] their window envelope (0 after reset: a stream's start)
    frames_done: torch.Tensor    # [S] int64 code frames decoded since reset


class RVQCodec(nn.Module):
    """The codec under `tts_model.audio_codec.` (spec 5). Always fp32."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        if math.prod(cfg.rates) * cfg.hop_length != cfg.wav_to_token_ratio:
            raise ValueError(f"prod(rates) * hop_length must equal wav_to_token_ratio: {cfg}")
        if cfg.n_fft % cfg.hop_length or (cfg.n_fft - cfg.hop_length) % 2:
            raise ValueError(f"n_fft must be a multiple of hop_length with an even difference: {cfg}")
        self.cfg = cfg
        self.encoder = Wav2Latent(cfg)
        self.decoder = Latent2Wav(cfg)
        self.prvq = ResidualVQ(cfg)
        self.keep_presplit = False  # presplit_weights was called: keep them built and current
        self.gemm = cfg.gemm   # checks the name (ValueError) and makes `gemm_kind`
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.weights_loaded())
        # decode_step's constants (not in the state_dict): built once here and after every cast or move
        # (`_apply`), not in every step (they were ~15 small launches of each captured frame step)
        for name in ("step_window", "step_inner_bins", "step_envelope", "step_head"):
            self.register_buffer(name, torch.empty(0), persistent=False)
        self._build_step_constants()

    @torch.no_grad()
    def _build_step_constants(self) -> None:
        """step_window: the periodic Hann window [n_fft]; step_inner_bins: 1 for the complex bins, 0 for DC and
        Nyquist [n_fft / 2 + 1]; step_envelope: the window envelope of one code frame's spectrogram frames
        [1, 1764 + n_fft - hop]; step_head: the first `stream_delay` output samples of a frame [1764] (bool).
        Always fp32 whatever the module was cast to (the codec runs in fp32, spec 9.9)."""
        device = self.step_window.device
        n_fft, hop = self.cfg.n_fft, self.cfg.hop_length
        inner = torch.ones(n_fft // 2 + 1, device=device)
        inner[0] = inner[-1] = 0.0
        self.step_window = hann_window(n_fft, device)
        self.step_inner_bins = inner
        self.step_envelope = window_envelope(self.samples_per_frame // hop, n_fft, hop, device)
        self.step_head = torch.arange(self.samples_per_frame, device=device) < self.stream_delay

    @property
    def samples_per_frame(self) -> int:  # 1764
        return self.cfg.wav_to_token_ratio

    @property
    def stream_delay(self) -> int:
        """Samples by which `decode_step`'s stream lags the one-shot decode: (n_fft - hop) / 2 = 6."""
        return (self.cfg.n_fft - self.cfg.hop_length) // 2

    @property
    def gemm(self) -> str:
        """The decoder GEMMs' kind by name (CodecConfig.gemm, e.g. "auto"). Setting it checks the name
        (ValueError) and makes the kind they run as, `gemm_kind`, once (`_choose_gemm`)."""
        return self._gemm

    @gemm.setter
    def gemm(self, name: str) -> None:
        self._choose_gemm(name)

    def _choose_gemm(self, name: str) -> None:
        """`gemm_kind`: `name` resolved for the weights' device (codec.codec_gemm: "auto", the row line, the
        Triton kernels there or not); the weights split again for it where presplit_weights was called."""
        self.gemm_kind: Gemm = codec_gemm(name, self.decoder.layers[-1].weight.device)
        self._gemm = name
        if self.keep_presplit:
            self._build_presplit()

    def _require_fp32(self) -> None:
        for name, tensor in self.named_parameters():
            if tensor.dtype != torch.float32:
                raise TypeError(f"the codec runs in fp32 only (spec 9.9: bf16 collapses the reconstruction); "
                                f"{name} is {tensor.dtype}. Keep the codec out of dtype casts (model.codec.float()).")

    # ---- one-shot ------------------------------------------------------------------------------------
    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T, Q] -> latent [B, T, latent] (spec 5.1)."""
        return self.prvq.dequantize(codes)

    def decode(self, codes: torch.Tensor, by_matmul: bool = False,
               silence_codes: torch.Tensor | None = None) -> torch.Tensor:
        """codes [B, T, Q] -> wav [B, 1764 T] fp32. `silence_codes` [Q], if given, replaces control codes
        first (spec 5.4); otherwise every code must be < codebook_size. `by_matmul` uses ops.dft's inverse
        DFT instead of torch.fft.irfft (what decode_step uses)."""
        self._require_fp32()
        if silence_codes is not None:
            codes = replace_control_codes(codes, silence_codes, self.cfg.codebook_size)
        with exact_fp32(codes.device):
            head = self.decoder(self.dequantize(codes).transpose(1, 2), self.gemm_kind)
            return istft(head, self.cfg.n_fft, self.cfg.hop_length, by_matmul)

    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        """wav [B, N] fp32 at 22.05 kHz, N a multiple of 1764 -> codes [B, N / 1764, Q] (spec 5.5)."""
        self._require_fp32()
        if wav.shape[-1] % self.samples_per_frame:
            raise ValueError(f"encode needs a multiple of {self.samples_per_frame} samples; got {wav.shape[-1]}")
        with exact_fp32(wav.device):
            latent = self.encoder(wav.float()).transpose(1, 2)
            return self.prvq.quantize(latent)

    @torch.no_grad()
    def silence_codes(self, seconds: float = 10.0, sample_rate: int = 22050) -> torch.Tensor:
        """The most frequent code frame when encoding `seconds` of zeros, [Q] int64 (spec 5.5,
        `get_codec_silence_frame`). Ties go to the lexicographically smallest frame. The checkpoint's
        stored `codec_silence_tokens` is what the reference uses; this recomputes it."""
        num_frames = max(1, int(seconds * sample_rate) // self.samples_per_frame)
        device = self.prvq.mus_list[0].device
        codes = self.encode(torch.zeros(1, num_frames * self.samples_per_frame, device=device))[0]
        frames, counts = torch.unique(codes, dim=0, return_counts=True)  # sorted lexicographically
        return frames[counts.argmax()]

    # ---- streaming -----------------------------------------------------------------------------------
    def allocate_stream_state(self, num_slots: int, device) -> CodecStreamState:
        """Zeroed state for `num_slots` rows (callers include the sink row). Also builds the stacked
        codebooks here, before any step is captured or compiled, so a traced step only reads them."""
        self.prvq.stacked()
        tail = self.cfg.n_fft - self.cfg.hop_length
        history = [torch.zeros(num_slots, block.history, block.dwconv.in_channels, device=device)
                   for block in self.decoder.convnext_blocks()]
        return CodecStreamState(
            convnext_history=history,
            ola_tail=torch.zeros(num_slots, tail, device=device),
            envelope_tail=torch.zeros(num_slots, tail, device=device),
            frames_done=torch.zeros(num_slots, dtype=torch.int64, device=device))

    @staticmethod
    def reset_slots(state: CodecStreamState, slots: torch.Tensor) -> None:
        """Rows `slots` back to a stream's start (zero history = the one-shot causal zero padding)."""
        for history in state.convnext_history:
            history.index_fill_(0, slots, 0.0)
        state.ola_tail.index_fill_(0, slots, 0.0)
        state.envelope_tail.index_fill_(0, slots, 0.0)
        state.frames_done.index_fill_(0, slots, 0)

    @torch.no_grad()
    def decode_step(self, codes: torch.Tensor, state: CodecStreamState, slots: torch.Tensor,
                    silence_codes: torch.Tensor | None = None) -> torch.Tensor:
        """One code frame per call: codes [B, Q], slots [B] -> wav [B, 1764] fp32, which is the one-shot
        decode of the call's frames so far delayed by `stream_delay` samples (6 zeros at a stream's start).
        Pure tensor code with fixed shapes (CUDA-graph capturable); the iSTFT tail is ops/istft_step.py, its
        inverse DFT a dot with ops.dft's basis."""
        self._require_fp32()
        if silence_codes is not None:
            codes = replace_control_codes(codes, silence_codes, self.cfg.codebook_size)
        hop = self.cfg.hop_length
        with exact_fp32(codes.device):
            latent = self.dequantize(codes[:, None, :])  # [B, 1, latent]
            head = self.decoder.step(latent, state.convnext_history, slots, self.gemm_kind)  # [B, 441, 18]
            # the iSTFT, overlap-add with the state's tails, envelope division, before-start zeros and the
            # state update: one kernel (ops/istft_step.py; its torch reference on the CPU)
            return istft_step(head, self.step_window, self.step_inner_bins, self.step_envelope, self.step_head,
                              state.ola_tail, state.envelope_tail, state.frames_done, slots, hop)

    @torch.no_grad()
    def flush_step(self, state: CodecStreamState, slots: torch.Tensor) -> torch.Tensor:
        """The last `stream_delay` samples of the one-shot decode, [B, 6] (zeros for a slot with no frames).
        Reads the state, changes nothing."""
        delay = self.stream_delay
        signal = state.ola_tail.index_select(0, slots)[:, :delay]
        envelope = state.envelope_tail.index_select(0, slots)[:, :delay]
        return torch.where(envelope > 0, signal / envelope.clamp_min(1e-30), 0.0)

    # ---- weights -------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Seeded random weights keeping activations O(1); codewords distinct (continuous draws)."""
        self.encoder.init_weights(generator)
        self.decoder.init_weights(generator)
        self.prvq.init_weights(generator)
        self.weights_loaded()

    @torch.no_grad()
    def presplit_weights(self) -> None:
        """Split every decoder GEMM weight of decode_step (ConvNeXt pwconv1/pwconv2, the upsampling layers
        in their channels-last row order, the final k=1 conv) once for the GEMM kernel that multiplies by it
        (`gemm_kind.split_weight`: TF32 halves for tf32x3w, scaled fp16 halves for fp16x3w) into buffers
        (Latent2Wav.step_gemms), so the GEMMs take them as they are: for tf32x3w, without them every step
        ran split_tf32 over the ~92 M weights (0.26 ms in an H200 profile) and copied the upsampling weights
        into their row order; with them decode_step took 0.38 / 0.36 / 0.47 / 0.44 ms less at 8 / 32 / 64 /
        128 calls on the H200, bit for bit the same output (scripts/dev/bench_ops.py --only codec).
        fp16x3w has no per-step split kernel (its weight split is torch code). Bytes per weight: 2 x 4
        (tf32x3w: 700 MiB at full size) or 2 x 2 plus 4 per output channel (fp16x3w: 350 MiB), counted by
        memory.derived_table_bytes. Made with the GEMMs' kind again (`_choose_gemm`), then built only where
        decode_step reads them (`gemm_kind.takes_split`: tf32x3w or fp16x3w on CUDA, or on the CPU under
        TRITON_INTERPRET=1) and kept current from then on: re-split in place when weights are loaded
        (`weights_loaded`: load_state_dict, checkpoint.load_state, init_weights), rebuilt from the new
        weights after a cast or move or for a new `gemm`, or dropped where no longer read (`_apply`).
        VoiceChat.cast_for_inference calls it. Weights written in place any other way need `weights_loaded`."""
        self.keep_presplit = True
        self._choose_gemm(self.gemm)

    def weights_loaded(self) -> None:
        """The weights were overwritten in place: the splits are re-made, into the same memory where the
        shapes allow (a captured graph keeps reading them)."""
        if self.keep_presplit:
            self._build_presplit()

    @torch.no_grad()
    def _build_presplit(self) -> None:
        """Split where `gemm_kind` takes the splits (into the tables already there when they fit: a
        captured graph keeps its pointers), else drop."""
        device = self.decoder.layers[-1].weight.device
        kind = self.gemm_kind
        build = kind.takes_split and all(
            layer.weight.dtype == torch.float32 for _, _, layer in self.decoder.step_gemms())
        for holder, name, layer in self.decoder.step_gemms():
            if not build:
                setattr(holder, name, torch.empty(0, device=device))
                continue
            setattr(holder, name, kind.split_weight(gemm_weight(layer), out=getattr(holder, name)))

    def _apply(self, fn, *args, **kwargs):
        if self.keep_presplit:  # not moved or cast: made again from the moved or cast weights below
            for holder, name, layer in self.decoder.step_gemms():
                setattr(holder, name, torch.empty(0, device=layer.weight.device))
        out = super()._apply(fn, *args, **kwargs)
        self._build_step_constants()   # a cast would leave them rounded; a move keeps the values
        self._choose_gemm(self.gemm)     # for the new device (and the splits, where kept)
        return out
