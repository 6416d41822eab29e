"""Auxiliary RNN-T head: the user's transcript from the encoder output before `proj` (spec 2.10).

Prediction net: embedding (blank = vocab_size is the padding row, a zero vector) -> 2-layer LSTM.
Joint: relu(enc(f) + pred(g)) -> Linear to vocab_size + 1 logits. Greedy rule (NeMo GreedyRNNTInfer):
per encoder frame, repeat up to max_symbols times: run the prediction net on the last emitted token
(start of sequence = zero input) from the committed LSTM state, take the argmax of the joint; blank ends
the frame, any other token is emitted and commits the LSTM state and the last token.

Two forms: `rnnt_greedy_decode` (offline, one call, plain loops) and `RNNTDecoder.stream_step` (one frame
for a batch of calls with per-slot state, a fixed max_symbols iterations with masks: graph friendly).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nemo_duplex.models.config import RNNTConfig
from ops.rnnt_commit import rnnt_commit


def _fill_normal_(tensor: torch.Tensor, std: float, generator: torch.Generator, mean: float = 0.0) -> None:
    draw = torch.randn(tensor.shape, generator=generator, device=generator.device) * std + mean
    with torch.no_grad():
        tensor.copy_(draw.to(tensor.device, tensor.dtype))


class LSTMWeights(nn.Module):
    """The parameters of a multi-layer nn.LSTM under nn.LSTM's own names (`weight_ih_l0`, `bias_hh_l1`,
    ...), stepped by `lstm_step`. Not nn.LSTM itself: Dynamo refuses to trace nn.LSTM, and the
    prediction net only ever takes one step at a time."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int):
        super().__init__()
        self.num_layers = num_layers
        for layer in range(num_layers):
            n_in = input_size if layer == 0 else hidden_size
            self.register_parameter(f"weight_ih_l{layer}", nn.Parameter(torch.empty(4 * hidden_size, n_in)))
            self.register_parameter(f"weight_hh_l{layer}", nn.Parameter(torch.empty(4 * hidden_size, hidden_size)))
            self.register_parameter(f"bias_ih_l{layer}", nn.Parameter(torch.zeros(4 * hidden_size)))
            self.register_parameter(f"bias_hh_l{layer}", nn.Parameter(torch.zeros(4 * hidden_size)))


class PredictionRNN(nn.Module):
    """Holds the LSTM under NeMo's path `dec_rnn.lstm`."""

    def __init__(self, cfg: RNNTConfig):
        super().__init__()
        self.lstm = LSTMWeights(cfg.pred_hidden, cfg.pred_hidden, cfg.pred_rnn_layers)


class PredictionNetwork(nn.Module):
    def __init__(self, cfg: RNNTConfig):
        super().__init__()
        self.blank = cfg.vocab_size
        self.embed = nn.Embedding(cfg.vocab_size + 1, cfg.pred_hidden, padding_idx=cfg.vocab_size)
        self.dec_rnn = PredictionRNN(cfg)

    def forward(self, token: torch.Tensor, h: torch.Tensor, c: torch.Tensor):
        """token [B] (blank = start of sequence), h, c [layers, B, H] -> (g [B, H], h', c').
        The blank input is forced to zero, whatever the checkpoint's padding row holds (spec 2.10)."""
        x = self.embed(token) * (token != self.blank)[:, None].to(self.embed.weight.dtype)
        return lstm_step(self.dec_rnn.lstm, x, h, c)


def lstm_step(lstm: nn.Module, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor):
    """One time step of a multi-layer LSTM written out (gates i, f, g, o in nn.LSTM's order) over
    nn.LSTM-named parameters (an nn.LSTM or LSTMWeights), so the step can be captured by torch.compile
    and needs no cuDNN weight compaction. x [B, H_in], h/c [layers, B, H] -> (out [B, H], h', c')."""
    hs, cs = [], []
    for layer in range(lstm.num_layers):
        # gates = x W_ih^T + b_ih + h W_hh^T + b_hh; i, f, g, o = chunks; c' = s(f) c + s(i) tanh(g);
        # h' = s(o) tanh(c'). torch.lstm_cell is that math with the gate arithmetic in one fused kernel on
        # CUDA (in fp32, as cuDNN's LSTM, which NeMo runs), instead of ten small kernels per layer.
        x, c_new = torch.lstm_cell(x, (h[layer], c[layer]),
                                   getattr(lstm, f"weight_ih_l{layer}"), getattr(lstm, f"weight_hh_l{layer}"),
                                   getattr(lstm, f"bias_ih_l{layer}"), getattr(lstm, f"bias_hh_l{layer}"))
        hs.append(x)
        cs.append(c_new)
    return x, torch.stack(hs), torch.stack(cs)


@dataclass
class RNNTStreamState:
    """Per-slot prediction-net state; the last row is the sink for padding rows."""
    h: torch.Tensor           # [layers, S, H] committed LSTM state
    c: torch.Tensor           # [layers, S, H]
    last_token: torch.Tensor  # [S] int64 last emitted token, blank = none yet (zero input)


class RNNTDecoder(nn.Module):
    """`stt_model.rnnt_decoder`: `prediction.embed`, `prediction.dec_rnn.lstm`."""

    def __init__(self, cfg: RNNTConfig):
        super().__init__()
        self.cfg = cfg
        self.blank = cfg.vocab_size
        self.prediction = PredictionNetwork(cfg)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator):
        embed = self.prediction.embed.weight
        _fill_normal_(embed, 1.0, generator)
        embed[self.blank].zero_()  # the padding row stays zero, as in training
        bound = 1.0 / math.sqrt(self.cfg.pred_hidden)
        for _, p in sorted(self.prediction.dec_rnn.lstm.named_parameters()):
            _fill_normal_(p, bound, generator)

    def initial_state(self, batch: int, device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.cfg.pred_rnn_layers, batch, self.cfg.pred_hidden)
        return torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)

    def allocate_stream_state(self, num_slots: int, device, dtype: torch.dtype | None = None) -> RNNTStreamState:
        h, c = self.initial_state(num_slots, device, dtype or self.prediction.embed.weight.dtype)
        last = torch.full((num_slots,), self.blank, dtype=torch.int64, device=device)
        return RNNTStreamState(h=h, c=c, last_token=last)

    def reset_slots(self, state: RNNTStreamState, slots: torch.Tensor) -> None:
        state.h.index_fill_(1, slots, 0.0)
        state.c.index_fill_(1, slots, 0.0)
        state.last_token.index_fill_(0, slots, self.blank)

    @torch.no_grad()
    def stream_step(self, joint: "RNNTJoint", enc: torch.Tensor, state: RNNTStreamState,
                    slots: torch.Tensor) -> torch.Tensor:
        """enc [B, d_enc] (one encoder frame per call, before proj), slots [B] -> tokens [B, max_symbols]
        int64, emitted tokens first, -1 padded. Always max_symbols iterations; rows that saw blank stop
        emitting and committing (masked), so the op sequence does not depend on the data."""
        h, c, last = state.h[:, slots], state.c[:, slots], state.last_token[slots]
        tokens, h, c, last = self.decode_frame(joint, enc, h, c, last)
        state.h.index_copy_(1, slots, h)
        state.c.index_copy_(1, slots, c)
        state.last_token.index_copy_(0, slots, last)
        return tokens

    def decode_frame(self, joint: "RNNTJoint", enc: torch.Tensor, h: torch.Tensor, c: torch.Tensor,
                     last: torch.Tensor):
        """The pure part of stream_step (no state pools): -> (tokens, h, c, last) after this frame."""
        batch = enc.shape[0]
        f = joint.enc(enc.to(joint.enc.weight.dtype))
        tokens = torch.full((batch, self.cfg.max_symbols_per_step), -1, dtype=torch.int64, device=enc.device)
        active = torch.ones(batch, dtype=torch.bool, device=enc.device)
        h, c, last = h.clone(), c.clone(), last.clone()  # committed in place below; the caller's stay as they were
        for i in range(self.cfg.max_symbols_per_step):
            g, h_next, c_next = self.prediction(last, h, c)
            # argmax, emit = active & not blank, then tokens[:, i], h, c, last and active where emitted:
            # one kernel on the GPU (ops/rnnt_commit.py)
            rnnt_commit(joint.joint_logits(f, g), self.blank, active, h_next, h, c_next, c, last, tokens, i)
        return tokens, h, c, last


class RNNTJoint(nn.Module):
    """`stt_model.rnnt_joint`: `enc`, `pred`, `joint_net` = [ReLU, Dropout, Linear] (key `joint_net.2`)."""

    def __init__(self, cfg: RNNTConfig, encoder_hidden: int):
        super().__init__()
        self.enc = nn.Linear(encoder_hidden, cfg.joint_hidden)
        self.pred = nn.Linear(cfg.pred_hidden, cfg.joint_hidden)
        self.joint_net = nn.Sequential(nn.ReLU(), nn.Dropout(0.0), nn.Linear(cfg.joint_hidden, cfg.vocab_size + 1))
        self.out_padded: tuple[torch.Tensor, torch.Tensor] | None = None  # (weight, bias); see pad_output

    @torch.no_grad()
    def pad_output(self, multiple: int = 8) -> None:
        """Give the output Linear (1025 classes) zero rows up to a multiple of `multiple`, in one tensor whose
        first rows ARE the module's weight and bias (re-pointed views, so loading a state_dict writes into
        it), and compute the logits through the padded GEMM, then slice. Why: a 1025-wide bf16 output's rows
        are not 16-byte aligned, and cuBLAS then runs an `align1` kernel: 0.26 / 0.63 ms per step at N=32 /
        128 for the ten symbol steps (H200 profile, docs/performance.md). Re-done after every cast
        or move (`_apply`), which gives each parameter a tensor of its own again."""
        out = self.joint_net[2]
        classes = out.out_features
        rows = -(-classes // multiple) * multiple
        weight = out.weight.new_zeros(rows, out.in_features)
        bias = out.bias.new_zeros(rows)
        weight[:classes] = out.weight
        bias[:classes] = out.bias
        out.weight = nn.Parameter(weight[:classes], requires_grad=out.weight.requires_grad)
        out.bias = nn.Parameter(bias[:classes], requires_grad=out.bias.requires_grad)
        self.out_padded = (weight, bias)

    def _apply(self, fn, *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        if self.out_padded is not None:
            self.pad_output()
        return result

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator):
        for linear in (self.enc, self.pred, self.joint_net[2]):
            _fill_normal_(linear.weight, 1.0 / math.sqrt(linear.in_features), generator)
            _fill_normal_(linear.bias, 0.1, generator)

    def joint_logits(self, f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """f = enc(frame) [B, J], g = prediction output [B, H] -> raw logits [B, vocab+1] (argmax only)."""
        if self.out_padded is None:
            return self.joint_net(f + self.pred(g))
        weight, bias = self.out_padded  # joint_net = [ReLU, Dropout(p=0), Linear]
        return F.linear(torch.relu(f + self.pred(g)), weight, bias)[:, :self.joint_net[2].out_features]


@torch.no_grad()
def rnnt_greedy_decode(decoder: RNNTDecoder, joint: RNNTJoint, enc: torch.Tensor) -> list[int]:
    """Offline greedy decode of one call: enc [T, d_enc] (before proj) -> token ids (no blanks)."""
    dtype = joint.enc.weight.dtype
    f_all = joint.enc(enc.to(dtype))
    h, c = decoder.initial_state(1, enc.device, dtype)
    last = torch.full((1,), decoder.blank, dtype=torch.int64, device=enc.device)
    out: list[int] = []
    for t in range(enc.shape[0]):
        for _ in range(decoder.cfg.max_symbols_per_step):
            g, h_next, c_next = decoder.prediction(last, h, c)
            k = int(joint.joint_logits(f_all[t:t + 1], g).argmax(-1))
            if k == decoder.blank:
                break
            out.append(k)
            h, c, last = h_next, c_next, torch.tensor([k], device=enc.device)
    return out
