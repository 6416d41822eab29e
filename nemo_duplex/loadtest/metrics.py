"""The server's side of a load-test run: its Prometheus page (GET /metrics) and its GPU memory (nvidia-smi),
sampled through the run, and the per-interval step time, batch and throughput they give.
"""
from __future__ import annotations

import asyncio
import re
import shutil
import time

METRIC = re.compile(r"^(duplex_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN|\+Inf)$")


# labelled samples kept apart, as "<name>:<label value>" (the rest are summed by name)
BY_LABEL = {"duplex_stalled_seconds": "part", "duplex_admission_pieces_total": "start"}


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled duplex_* samples of a Prometheus text page (labelled ones are summed by name, but those
    of BY_LABEL's names, which are kept per label value)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = METRIC.match(line)
        if m and not (m.group(2) and "le=" in m.group(2)):
            name = m.group(1)
            if name in BY_LABEL and m.group(2):
                label = re.search(rf'{BY_LABEL[name]}="([^"]*)"', m.group(2))
                name = f"{name}:{label.group(1)}" if label else name
            out[name] = out.get(name, 0.0) + float(m.group(3))
    return out


async def gpu_memory_used(server_pid: int | None) -> int | None:
    """Bytes of GPU memory the server process uses (the whole GPU's when the process is not listed,
    e.g. in a container that hides host pids); None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    async def query(*args) -> str:
        p = await asyncio.create_subprocess_exec("nvidia-smi", *args, "--format=csv,noheader,nounits",
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        return (await p.communicate())[0].decode()
    if server_pid is not None:
        for line in (await query("--query-compute-apps=pid,used_memory")).splitlines():
            pid, _, mib = line.partition(",")
            if pid.strip() == str(server_pid):
                return int(float(mib)) * 2 ** 20
    lines = (await query("--query-gpu=memory.used")).split()
    return int(float(lines[0])) * 2 ** 20 if lines else None


async def poll_server(http, url: str, every_s: float, stop: asyncio.Event, server_pid: int | None,
                      samples: list[dict]) -> None:
    """Sample /metrics (and GPU memory) every `every_s` until `stop`, once more after it."""
    while True:
        t = time.monotonic()
        try:
            async with http.get(f"{url}/metrics") as r:
                m = parse_metrics(await r.text())
            m["t"] = t
            m["gpu_memory_bytes"] = await gpu_memory_used(server_pid)
            samples.append(m)
        except Exception:  # a missed sample is not a failed run
            pass
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, every_s - (time.monotonic() - t)))
        except asyncio.TimeoutError:
            pass


def admission_pieces(samples: list[dict]) -> dict[str, int]:
    """Admission pieces the server's admission thread started during the run, in a gap between steps or after
    waiting engine.admission_gap_wait_ms for one (duplex_admission_pieces_total, first sample to last)."""
    if len(samples) < 2:
        return {}
    key = "duplex_admission_pieces_total:"
    return {start: int(samples[-1].get(key + start, 0) - samples[0].get(key + start, 0)) for start in ("gap", "waited")}


def timeline(samples: list[dict], t0: float) -> list[dict]:
    """Per interval between two metrics samples: mean step ms, mean batch, frames/s, active calls."""
    rows = []
    for a, b in zip(samples, samples[1:]):
        steps = b.get("duplex_steps_total", 0) - a.get("duplex_steps_total", 0)
        frames = b.get("duplex_frames_total", 0) - a.get("duplex_frames_total", 0)
        busy = b.get("duplex_step_seconds_sum", 0) - a.get("duplex_step_seconds_sum", 0)
        phase = {p: (b.get(f"duplex_step_{p}_seconds_total", 0) - a.get(f"duplex_step_{p}_seconds_total", 0))
                 for p in ("gather", "prep", "device", "dispatch")}
        padded = b.get("duplex_padded_rows_total", 0) - a.get("duplex_padded_rows_total", 0)
        dt = b["t"] - a["t"]
        rows.append({"t": round(b["t"] - t0, 3), "steps": int(steps),
                     "step_ms": 1000 * busy / steps if steps else None,
                     "batch": frames / steps if steps else None,
                     "padded_batch": padded / steps if steps else None,
                     **{f"{p}_ms": 1000 * v / steps if steps else None for p, v in phase.items()},
                     "frames_per_s": frames / dt if dt > 0 else None,
                     "active_calls": b.get("duplex_active_calls"),
                     # a step or an admission under way past the server's bound (engine.max_step_s, ...)
                     "stalled_engine_s": b.get("duplex_stalled_seconds:engine", 0.0),
                     "stalled_admission_s": b.get("duplex_stalled_seconds:admission", 0.0),
                     "gpu_memory_bytes": b.get("gpu_memory_bytes")})
    return rows
