"""A call's admission as CUDA graphs (engine.prefill_graphs): the prompt's prefill, one graph per piece
size, and the talker's speaker warm-up, each over the engine's state pools.

Why: admission launched op by op is host-bound (a 500-token prompt on the H200: 0.35-0.46 s, against 85 ms
replayed: docs/performance.md, "Admission beside live calls"), and on the admission thread that host time
takes the GIL from the engine thread and the server's event loop while the live calls wait for their
packets. A prompt is prefilled in pieces whose sizes are powers of two (frame_step.prompt_pieces), so a
handful of graphs, sizes 1, 2, 4 .. engine.prefill_chunk_tokens, covers every prompt exactly: no padding,
which a Mamba layer's state could not ignore. The warm-up's keys and values are the speaker's alone:
computed once per speaker, copied into the slot by a graph. The eager admission runs the same pieces, so
captured and eager compute the same thing (tests/test_admission_graphs.py).
"""
from __future__ import annotations

import logging
import time

import torch

from graphs.shapes import ShapeGraphs
from nemo_duplex.serving.state import CallState

log = logging.getLogger(__name__)


def piece_sizes(largest: int) -> list[int]:
    """The piece sizes a prompt's prefill uses with pieces of at most `largest` tokens (a power of two)."""
    if largest < 1 or largest & (largest - 1):
        raise ValueError(f"engine.prefill_chunk_tokens = {largest}: captured prefill (engine.prefill_graphs) "
                         "needs pieces of a power of two tokens")
    return [1 << i for i in range(largest.bit_length())]


class AdmissionGraphs:
    """`prefill(x, slot, start)` and `warmup(slot, speaker)` for frame_step.admission, replayed from CUDA
    graphs captured over `state` by `capture` (graphs=True), or run eagerly (graphs=False: the same calls,
    which is what the CPU tests check). slot, start: int64 [1] tensors on the state's device.

    The talker's warm-up depends on the speaker alone (talker.warmup_kv), so its keys and values are
    computed once per speaker, eagerly (the char encoder and the warm-up's masks are not worth a graph
    for one run), and each admission replays only their copy into the slot's pages."""

    def __init__(self, model, state: CallState, largest_piece: int, graphs: bool):
        self.model, self.state = model, state
        # a piece never runs past the pool (admission trims a prompt to engine.max_prompt_tokens); eager, any
        # piece size runs as it comes
        self.sizes = [n for n in piece_sizes(largest_piece) if n <= state.llm.max_len] if graphs else []
        device = state.llm_len.device
        self.prefills = ShapeGraphs(self._prefill, device, graphs)
        self.warmup_writes = ShapeGraphs(self._write_warmup, device, graphs)
        self.speaker_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _prefill(self, x: torch.Tensor, slot: torch.Tensor, start: torch.Tensor) -> None:
        self.model.llm.prefill(x, self.state.llm, slot, start)

    def _write_warmup(self, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.model.talker.write_warmup(self.state.talker, slot, k, v)

    def capture(self) -> None:
        """Record every piece size and the warm-up's copy (for the default speaker's shape: speakers whose
        latent has another length run it eagerly) on the sink slot: what the recording computes lands in
        the rows that padding rows point at, which no call reads."""
        if not self.prefills.graphs:
            return
        started = time.perf_counter()
        device = self.state.llm_len.device
        sink = torch.full((1,), self.state.sink, dtype=torch.int64, device=device)
        start = torch.zeros(1, dtype=torch.int64, device=device)
        embed = self.model.stt_model.embed_tokens.weight
        for size in self.sizes:
            self.prefills.capture(size, torch.zeros(1, size, embed.shape[1], dtype=embed.dtype, device=device),
                                  sink, start)
        k, v = self._speaker(self.model.cfg.talker.speaker)
        self.warmup_writes.capture(tuple(k.shape), sink, k, v)
        log.info("captured the admission (prefill pieces of %s tokens, the warm-up's copy) in %.1f s",
                 ", ".join(map(str, self.sizes)), time.perf_counter() - started)

    def _speaker(self, speaker: str) -> tuple[torch.Tensor, torch.Tensor]:
        if speaker not in self.speaker_kv:
            with torch.no_grad():
                self.speaker_kv[speaker] = self.model.talker.warmup_kv(self.model.speaker_latent(speaker),
                                                                       self.model.silence_codes)
        return self.speaker_kv[speaker]

    def prefill(self, x: torch.Tensor, slot: torch.Tensor, start: torch.Tensor) -> None:
        """x [1, T, H] (T one of `sizes`) at positions start .. start + T - 1 of `slot`."""
        self.prefills(x.shape[1], x, slot, start)

    def warmup(self, slot: torch.Tensor, speaker: str | None = None) -> None:
        """The talker warm-up of `speaker` (None: the model's default) into `slot`."""
        k, v = self._speaker(speaker or self.model.cfg.talker.speaker)
        self.warmup_writes(tuple(k.shape), slot, k, v)
