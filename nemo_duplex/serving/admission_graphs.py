"""A call's admission as CUDA graphs (engine.prefill_graphs): the prompt's prefill, one graph per piece
size, and the talker's speaker warm-up, each over the engine's state pools.

Why: admission launched op by op is host-bound (a 500-token prompt: ~0.2 s of Python on the H200, for
~20 ms of device work), and on the admission thread that host time takes the GIL from the engine thread
and the server's event loop while 128 live calls wait for their packets (docs/performance.md, "Admission
beside live calls"). A prompt is prefilled in pieces whose sizes are powers of two (frame_step.prompt_pieces),
so a handful of graphs, sizes 1, 2, 4 .. engine.prefill_chunk_tokens, covers every prompt exactly: no
padding, which a Mamba layer's state could not ignore. The eager admission runs the same pieces, so
captured and eager compute the same thing (tests/test_admission_graphs.py).
"""
from __future__ import annotations

import torch

from graphs.shapes import ShapeGraphs
from nemo_duplex.serving.state import CallState


def piece_sizes(largest: int) -> list[int]:
    """The piece sizes a prompt's prefill uses with pieces of at most `largest` tokens (a power of two)."""
    if largest < 1 or largest & (largest - 1):
        raise ValueError(f"engine.prefill_chunk_tokens = {largest}: captured prefill (engine.prefill_graphs) "
                         "needs pieces of a power of two tokens")
    return [1 << i for i in range(largest.bit_length())]


class AdmissionGraphs:
    """`prefill(x, slot, start)` and `warmup(slot, latent)` for frame_step.admission, replayed from CUDA
    graphs captured over `state` by `capture` (graphs=True), or run eagerly (graphs=False: the same calls,
    which is what the CPU tests check). slot, start: int64 [1] tensors on the state's device."""

    def __init__(self, model, state: CallState, largest_piece: int, graphs: bool):
        self.model, self.state = model, state
        self.sizes = piece_sizes(largest_piece)
        device = state.llm_len.device
        self.prefills = ShapeGraphs(self._prefill, device, graphs)
        self.warmups = ShapeGraphs(self._warmup, device, graphs)

    def _prefill(self, x: torch.Tensor, slot: torch.Tensor, start: torch.Tensor) -> None:
        self.model.llm.prefill(x, self.state.llm, slot, start)

    def _warmup(self, slot: torch.Tensor, latent: torch.Tensor) -> None:
        self.model.talker.prefill_warmup(self.state.talker, slot, latent, self.model.silence_codes)

    def capture(self) -> None:
        """Record every piece size and the default speaker's warm-up (speakers whose latent has its shape
        share the graph; another shape runs eagerly), on the sink slot: what the recording computes lands
        in the rows that padding rows point at, which no call reads."""
        if not self.prefills.graphs:
            return
        device = self.state.llm_len.device
        sink = torch.full((1,), self.state.sink, dtype=torch.int64, device=device)
        start = torch.zeros(1, dtype=torch.int64, device=device)
        embed = self.model.stt_model.embed_tokens.weight
        for size in self.sizes:
            self.prefills.capture(size, torch.zeros(1, size, embed.shape[1], dtype=embed.dtype, device=device),
                                  sink, start)
        latent = self.model.speaker_latent()
        self.warmups.capture(tuple(latent.shape), sink, latent)

    def prefill(self, x: torch.Tensor, slot: torch.Tensor, start: torch.Tensor) -> None:
        """x [1, T, H] (T one of `sizes`) at positions start .. start + T - 1 of `slot`."""
        self.prefills(x.shape[1], x, slot, start)

    def warmup(self, slot: torch.Tensor, latent: torch.Tensor) -> None:
        self.warmups(tuple(latent.shape), slot, latent)
