"""RNN-T head: checkpoint keys, the offline greedy decode against an independent reference of the greedy
rule, and the batched per-frame streaming form against the offline decode."""
import random

import pytest
import torch

from nemo_duplex.models.config import RNNTConfig, tiny_config
from nemo_duplex.models.rnnt import RNNTDecoder, RNNTJoint, rnnt_greedy_decode


def test_state_dict_keys_and_shapes_full_size():
    cfg = RNNTConfig()
    with torch.device("meta"):
        decoder, joint = RNNTDecoder(cfg), RNNTJoint(cfg, 1024)
    want_decoder = {"prediction.embed.weight": (1025, 640)}
    for layer in (0, 1):
        want_decoder.update({f"prediction.dec_rnn.lstm.weight_ih_l{layer}": (2560, 640),
                             f"prediction.dec_rnn.lstm.weight_hh_l{layer}": (2560, 640),
                             f"prediction.dec_rnn.lstm.bias_ih_l{layer}": (2560,),
                             f"prediction.dec_rnn.lstm.bias_hh_l{layer}": (2560,)})
    want_joint = {"enc.weight": (640, 1024), "enc.bias": (640,), "pred.weight": (640, 640), "pred.bias": (640,),
                  "joint_net.2.weight": (1025, 640), "joint_net.2.bias": (1025,)}
    assert {k: tuple(v.shape) for k, v in decoder.state_dict().items()} == want_decoder
    assert {k: tuple(v.shape) for k, v in joint.state_dict().items()} == want_joint


def build(seed=0, blank_shift=0.0, max_symbols=None):
    cfg = tiny_config().rnnt
    if max_symbols is not None:
        cfg = RNNTConfig(**{**cfg.__dict__, "max_symbols_per_step": max_symbols})
    d_enc = tiny_config().encoder.d_model
    decoder, joint = RNNTDecoder(cfg), RNNTJoint(cfg, d_enc)
    g = torch.Generator().manual_seed(seed)
    decoder.init_weights(g)
    joint.init_weights(g)
    with torch.no_grad():
        joint.joint_net[2].bias[cfg.vocab_size] += blank_shift  # tune how often blank wins
    return cfg, decoder, joint, d_enc


def reference_greedy(cfg, decoder, joint, enc):
    """The greedy rule written out with explicit LSTM cell maths from the weights (no nn.LSTM call)."""
    lstm, blank = decoder.prediction.dec_rnn.lstm, cfg.vocab_size
    layers = cfg.pred_rnn_layers
    h = [torch.zeros(cfg.pred_hidden) for _ in range(layers)]
    c = [torch.zeros(cfg.pred_hidden) for _ in range(layers)]
    last = None

    def predict(token, h, c):
        x = torch.zeros(cfg.pred_hidden) if token is None else decoder.prediction.embed.weight[token]
        h2, c2 = [], []
        for layer in range(layers):
            gates = (getattr(lstm, f"weight_ih_l{layer}") @ x + getattr(lstm, f"bias_ih_l{layer}")
                     + getattr(lstm, f"weight_hh_l{layer}") @ h[layer] + getattr(lstm, f"bias_hh_l{layer}"))
            i, f, gg, o = gates.chunk(4)
            cn = torch.sigmoid(f) * c[layer] + torch.sigmoid(i) * torch.tanh(gg)
            hn = torch.sigmoid(o) * torch.tanh(cn)
            h2.append(hn)
            c2.append(cn)
            x = hn
        return x, h2, c2

    out = []
    for t in range(enc.shape[0]):
        emitted = 0
        while emitted < cfg.max_symbols_per_step:
            g, h2, c2 = predict(last, h, c)
            logits = joint.joint_net[2](torch.relu(joint.enc(enc[t]) + joint.pred(g)))
            k = int(logits.argmax())
            if k == blank:
                break
            out.append(k)
            h, c, last = h2, c2, k
            emitted += 1
    return out


@torch.no_grad()
@pytest.mark.parametrize("seed,blank_shift", [(0, 0.0), (1, 1.0), (2, -0.5)])
def test_offline_greedy_equals_reference(seed, blank_shift):
    cfg, decoder, joint, d_enc = build(seed, blank_shift)
    enc = torch.randn(40, d_enc, generator=torch.Generator().manual_seed(seed + 10))
    got = rnnt_greedy_decode(decoder, joint, enc)
    want = reference_greedy(cfg, decoder, joint, enc)
    assert got == want
    assert 0 < len(got)  # tokens actually occur


@torch.no_grad()
def test_every_frame_at_max_symbols_when_blank_never_wins():
    cfg, decoder, joint, d_enc = build(3, blank_shift=-100.0, max_symbols=4)
    enc = torch.randn(6, d_enc, generator=torch.Generator().manual_seed(3))
    got = rnnt_greedy_decode(decoder, joint, enc)
    assert len(got) == 6 * 4
    assert got == reference_greedy(cfg, decoder, joint, enc)


@torch.no_grad()
@pytest.mark.parametrize("seed,blank_shift", [(0, 0.0), (4, -1.0),
                                              pytest.param(0, 1.0, marks=pytest.mark.triton_interpret)])
def test_streaming_equals_offline_batched(seed, blank_shift):
    """(The third case runs the symbol-step commit kernel of the GPU, ops/rnnt_commit.py, through the
    interpreter, with blank made likelier so that frames end early as well as fill all ten symbols.)"""
    cfg, decoder, joint, d_enc = build(seed, blank_shift)
    gen = torch.Generator().manual_seed(seed + 20)
    lengths, starts, slots = [16, 6, 12], [0, 3, 5], [2, 0, 3]  # calls at different frames, slots out of order
    encs = [torch.randn(n, d_enc, generator=gen) for n in lengths]
    num_slots = 5  # slot 1 stays idle, slot 4 is the sink
    sink = num_slots - 1
    state = decoder.allocate_stream_state(num_slots, "cpu")
    decoder.reset_slots(state, torch.tensor(slots))
    idle_before = (state.h[:, 1].clone(), state.c[:, 1].clone(), state.last_token[1].clone())
    streamed = [[] for _ in lengths]
    rng = random.Random(seed)
    per_frame_counts = []
    for step in range(max(s + n for s, n in zip(starts, lengths))):
        rows = [i for i in range(3) if starts[i] <= step < starts[i] + lengths[i]]
        rng.shuffle(rows)
        frames = [encs[i][step - starts[i]] for i in rows] + [torch.randn(d_enc, generator=gen)] * 2
        batch_slots = torch.tensor([slots[i] for i in rows] + [sink, sink])  # two padding rows
        tokens = decoder.stream_step(joint, torch.stack(frames), state, batch_slots)
        assert tokens.shape == (len(rows) + 2, cfg.max_symbols_per_step)
        for row, i in enumerate(rows):
            emitted = tokens[row][tokens[row] >= 0].tolist()
            assert tokens[row, len(emitted):].eq(-1).all()  # emitted first, then -1 padding
            streamed[i] += emitted
            per_frame_counts.append(len(emitted))
    for i in range(3):
        assert streamed[i] == rnnt_greedy_decode(decoder, joint, encs[i])
    assert sum(per_frame_counts) > 0 and max(per_frame_counts) >= 2  # multi-symbol frames happen
    assert torch.equal(state.h[:, 1], idle_before[0]) and torch.equal(state.c[:, 1], idle_before[1])
    assert state.last_token[1] == idle_before[2]


@torch.no_grad()
def test_blank_padding_row_is_zero_input():
    # Start of sequence is a zero input even if a checkpoint's padding row were not zero.
    cfg, decoder, joint, d_enc = build(5)
    enc = torch.randn(10, d_enc, generator=torch.Generator().manual_seed(5))
    want = rnnt_greedy_decode(decoder, joint, enc)
    decoder.prediction.embed.weight[cfg.vocab_size] = 3.0
    assert rnnt_greedy_decode(decoder, joint, enc) == want


def test_lstm_step_equals_nn_lstm():
    """The written-out LSTM step (compile friendly) is nn.LSTM's math: fp32, random weights, 1e-6."""
    from nemo_duplex.models.rnnt import lstm_step

    torch.manual_seed(3)
    lstm = torch.nn.LSTM(12, 12, num_layers=2)
    x = torch.randn(5, 12)
    h, c = torch.randn(2, 5, 12), torch.randn(2, 5, 12)
    out, (h_ref, c_ref) = lstm(x[None], (h, c))
    y, h2, c2 = lstm_step(lstm, x, h, c)
    assert torch.allclose(y, out[0], atol=1e-6) and torch.allclose(h2, h_ref, atol=1e-6)
    assert torch.allclose(c2, c_ref, atol=1e-6)


@torch.no_grad()
def test_padded_output_gives_the_same_logits_and_follows_loads_and_casts():
    """pad_output: the 1025-class output GEMM through a zero-padded weight (aligned rows for cuBLAS) gives
    the unpadded logits; loading a state_dict afterwards changes what the padded GEMM uses; a cast re-pads."""
    cfg, decoder, joint, d_enc = build(6)
    f = joint.enc(torch.randn(5, d_enc, generator=torch.Generator().manual_seed(6)))
    g = torch.randn(5, cfg.pred_hidden, generator=torch.Generator().manual_seed(7))
    plain = joint.joint_logits(f, g)
    joint.pad_output()
    weight, bias = joint.out_padded
    assert weight.shape[0] % 8 == 0 and weight.shape[0] >= cfg.vocab_size + 1 and bias.shape == weight.shape[:1]
    assert weight[cfg.vocab_size + 1:].eq(0).all() and bias[cfg.vocab_size + 1:].eq(0).all()
    padded = joint.joint_logits(f, g)
    assert padded.shape == plain.shape == (5, cfg.vocab_size + 1)
    torch.testing.assert_close(padded, plain, rtol=1e-6, atol=1e-6)  # fp32, only the GEMM's blocking differs
    assert {k: tuple(v.shape) for k, v in joint.state_dict().items()}["joint_net.2.weight"] == (cfg.vocab_size + 1,
                                                                                                cfg.joint_hidden)
    _, _, other, _ = build(8)
    joint.load_state_dict(other.state_dict())  # writes into the padded tensor's leading rows
    torch.testing.assert_close(joint.joint_logits(f, g), other.joint_logits(f, g), rtol=1e-6, atol=1e-6)
    joint.to(torch.float64)  # a cast gives each parameter its own tensor: pad_output runs again
    assert joint.out_padded[0].dtype == torch.float64
    assert joint.out_padded[0].data_ptr() == joint.joint_net[2].weight.data_ptr()
    torch.testing.assert_close(joint.joint_logits(f.double(), g.double()), other.joint_logits(f, g).double(),
                               rtol=1e-6, atol=1e-6)
