"""What the engine counts per step, for /metrics (server/metrics.py samples it)."""
from __future__ import annotations

from collections import deque


class EngineStats:
    """Counters the server exports on /metrics."""

    def __init__(self):
        self.steps = 0
        self.frames = 0
        self.step_seconds: deque[float] = deque(maxlen=1000)
        self.batch_sizes: deque[int] = deque(maxlen=1000)
        # where a step's wall time goes, summed over steps (/metrics): taking the calls' frames (before
        # the step), host work from the frames to the last launch, waiting for the device, handing the
        # frames out; and rows including capture-bucket padding
        self.gather_seconds = 0.0
        self.prep_seconds = 0.0
        self.device_seconds = 0.0
        self.dispatch_seconds = 0.0
        self.padded_rows = 0

    def record_step(self, batch: int, seconds: float, gather: float = 0.0, prep: float = 0.0, device: float = 0.0,
                    dispatch: float = 0.0, padded: int = 0) -> None:
        self.steps += 1
        self.gather_seconds += gather
        self.frames += batch
        self.step_seconds.append(seconds)
        self.batch_sizes.append(batch)
        self.prep_seconds += prep
        self.device_seconds += device
        self.dispatch_seconds += dispatch
        self.padded_rows += padded or batch
