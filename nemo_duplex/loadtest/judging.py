"""A load-test run's verdict from what its callers saw: per-frame lag percentiles, lateness against a
playback clock behind a jitter buffer, failed calls; and a sweep's sustained count per start mode.
"""
from __future__ import annotations

import numpy as np

from nemo_duplex.loadtest.callers import FRAME_S, CallRecord

SETTLED_FRAMES = round(2.0 / FRAME_S)   # a call's first 2 s (server_lag_after_2s_ms leaves them out)

UPLOADS_START = "staggered+uploads"  # the start label of loadtest.upload_runs' runs
ARRIVALS_START = "lockstep+arrivals"  # the start label of loadtest.arrival_runs' runs


def pct(values, qs=(50, 95, 99)) -> dict[str, float | None]:
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    out = {f"p{q}": (round(float(np.percentile(v, q)), 3) if v.size else None) for q in qs}
    out["max"] = round(float(v.max()), 3) if v.size else None
    return out


def lateness_ms(rec: CallRecord, jitter_buffer_ms: float) -> list[float]:
    """Per packet (in frame order): arrival - its playback time, the clock starting one jitter buffer
    after the first packet. Positive = the packet missed its slot (an underrun)."""
    if not rec.arrival:
        return []
    order = np.argsort(rec.frames, kind="stable")
    arr = np.asarray(rec.arrival)[order]
    k = np.asarray(rec.frames)[order] - rec.frames[order[0]]
    play = arr[0] + jitter_buffer_ms / 1000.0 + k * FRAME_S
    return ((arr - play) * 1000.0).tolist()


def call_failure(rec: CallRecord) -> str | None:
    """Why a call failed (None if it did not): an error, an abnormal end, or missing or misordered frames
    (a call is judged over its own length, rec.n_frames: with loadtest.length_mix calls differ)."""
    if rec.error:
        return rec.error.split(":")[0]
    if rec.ended != "completed":
        return f"ended_{rec.ended}" if rec.ended else "no_end"
    if rec.frames != list(range(rec.n_frames)):
        return "frames_missing_or_out_of_order"
    return None


def judge(records: list[CallRecord], jitter_buffer_ms: float) -> dict:
    """The latency and real-time verdict of a run's calls, each over its own frames."""
    failures: dict[str, int] = {}
    for r in records:
        why = call_failure(r)
        if why:
            failures[why] = failures.get(why, 0) + 1
    late = [x for r in records for x in lateness_ms(r, jitter_buffer_ms)]
    client = [a - r.sent[k] for r in records for k, a in zip(r.frames, r.arrival) if k < len(r.sent)]
    first = [r.arrival[0] - r.sent[0] for r in records if r.arrival and r.sent and r.frames[0] == 0]
    drain = [r.drained_at - r.sent[-1] for r in records if r.drained_at is not None and r.sent]
    slip = [s - (r.origin + k * FRAME_S) for r in records for k, s in enumerate(r.sent)]
    late_packets = sum(1 for x in late if x > 0)
    failed = sum(failures.values())
    events: dict[str, int] = {}
    for r in records:
        for e in r.errors:
            events[e.split(":")[0]] = events.get(e.split(":")[0], 0) + 1
    ms = lambda xs: [1000.0 * x for x in xs]   # noqa: E731
    return {
        "calls": len(records), "failed_calls": failed, "failures": failures, "error_events": events,
        "frames_expected": sum(r.n_frames for r in records), "frames_received": sum(len(r.frames) for r in records),
        "server_lag_ms": pct([x for r in records for x in r.server_lag_ms]),
        # the same without each call's first frame: a call with no frame yet has no rhythm for the engine's
        # coalescing, so first frames wait a step more, and in short calls they reach the top percentile
        "server_lag_after_first_ms": pct([x for r in records for k, x in zip(r.frames, r.server_lag_ms) if k > 0]),
        # and without each call's first 2 s: what is left is the steady state, not the calls' admissions (a
        # burst of callers) and the backlogs they leave
        "server_lag_after_2s_ms": pct([x for r in records for k, x in zip(r.frames, r.server_lag_ms)
                                       if k >= SETTLED_FRAMES]),
        "client_lag_ms": pct(ms(client)),
        "lateness_ms": pct(late), "late_packets": late_packets,
        "calls_with_late_packets": sum(1 for r in records if any(x > 0 for x in lateness_ms(r, jitter_buffer_ms))),
        "first_packet_ms": pct(ms(first), (50,)), "drain_ms": pct(ms(drain), (50, 95)),
        "send_slip_ms": pct(ms(slip), (99,)),   # this client's own scheduling delay: large = the client is the bottleneck
        "distinct_outputs": len({r.output_sha256 for r in records if r.frames}),
        "real_time": failed == 0 and late_packets == 0 and len(records) > 0,
    }


def sustained(rows: list[dict]) -> dict[str, int]:
    """Per start mode: the largest N such that every N' <= N in the sweep was real time (0 if none)."""
    out = {}
    for start in dict.fromkeys(r["start"] for r in rows if r["start"] not in (UPLOADS_START, ARRIVALS_START)):
        best = 0
        for r in sorted((r for r in rows if r["start"] == start), key=lambda r: r["n_calls"]):
            if not r.get("real_time"):
                break
            best = r["n_calls"]
        out[start] = best
    return out
