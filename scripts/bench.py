"""Capacity and latency under load, measured as a user would: N paced callers through the real server.

    # the H200 sweep: starts scripts/serve.py on the GPU (full size, bf16, random weights), sweeps N
    python scripts/bench.py model=nemotron_duplex model.weights=random device=cuda model/dtype=bf16 \\
        engine.graphs=true engine.graph_backend=cudagraph-eager loadtest.duration_s=20
    # over capture-bucket sets (one server per set; N is swept inside each job)
    python scripts/bench.py -m ... engine.capture_buckets=[1,8,32,64,128,160],[1,2,4,8,16,32,64,96,128,160]
    # against a server that is already running
    python scripts/bench.py loadtest.url=http://127.0.0.1:8000 loadtest.n_calls=[1,8]
    # the tiny model on the CPU (smoke test)
    python scripts/bench.py model.weights=random loadtest.n_calls=[2] loadtest.duration_s=2

Every caller sends the same input (loadtest.clip looped to loadtest.duration_s; its sha256 is recorded)
over the native protocol (/generate/ws: binary PCM both ways, the lightest of our protocols), one 80 ms
append at a time on an absolute schedule (append k leaves at origin + k * 80 ms), then end_input. The
callers start together ("lockstep") or spread over loadtest.stagger_s ("staggered"); optionally a
loadtest.upload_s WAV is POSTed to /generate every loadtest.upload_every_s, sharing the GPU: in every run
(loadtest.uploads=true), or after the sweep in one more staggered run per N of loadtest.upload_runs on the
same server ("staggered+uploads"), whose lag p99 is compared with the sweep's staggered run of that N.
loadtest.arrival_runs=[N]: after the sweep, N lockstep calls again while new calls arrive every
loadtest.arrival_every_s, each with a fresh system prompt of loadtest.arrival_prompt_tokens tokens (never
seen before: no prefix cache hit) and loadtest.arrival_s of audio sent at once ("lockstep+arrivals"); the
live calls' lag p99 is compared with the sweep's lockstep run of that N, and each arrival's time to its first
packet (its admission) is recorded. The prompts are made with the server's tokenizer (model.weights=random).

Per run (one start mode, one N):
  server lag      per frame, from the packet header: the frame's last input received -> its packet sent
  client lag      per frame: packet arrival - send of the frame's append (includes loopback and this client)
  lateness        per packet, against a playback clock that starts loadtest.jitter_buffer_ms after the first
                  packet (packet k plays at first arrival + J + k * 80 ms); > 0 is an underrun
  real time       no failed call and no late packet: no call's audio fell behind by more than the buffer
  drain           end of input (right after the last append) -> the server's "drained"
  step / batch    mean step time and mean batch size per metrics interval (GET /metrics)
  GPU memory      used by the server (nvidia-smi), and per call; the pools are allocated for
                  engine.max_calls at start, so the planned bytes per call (nemo_duplex/serving/memory.py) are beside it
The sustained count of a start mode is the largest N such that every N' <= N of the sweep was real time.
Results: load.json (rewritten after every run), calls/<start>_<N>.json (every packet's arrival),
summary.md, lag_vs_n.png, step_vs_n.png under loadtest.out (default $OUT or the Hydra run directory),
and W&B (wandb.mode, offline by default).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_duplex import runtime, settings  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FRAME_S = 0.08
settings.register()
FRAME_IN = 1280
HEADER_SIZE = 8   # <I frame, <f server lag ms (docs/protocol.md)


# =====================================================================================================
# Input: identical for every caller
# =====================================================================================================
def load_input(clip: str | None, seconds: float) -> tuple[bytes, str]:
    """The clip looped (or cut) to a whole number of 80 ms frames of PCM16 -> (bytes, sha256)."""
    from nemo_duplex.audio import read_wav, to_pcm16

    audio = read_wav(clip or REPO / "eval" / "clips" / "example.wav", 16000)
    n = max(1, round(seconds / FRAME_S)) * FRAME_IN
    audio = np.resize(audio, n)   # repeats the clip as often as needed
    pcm = to_pcm16(audio).tobytes()
    return pcm, hashlib.sha256(pcm).hexdigest()


# =====================================================================================================
# One paced caller
# =====================================================================================================
@dataclass
class CallRecord:
    """What one caller saw. Times are monotonic seconds of this process."""
    index: int
    origin: float                                     # when append 0 was due
    sent: list[float] = field(default_factory=list)   # append k left at sent[k]
    frames: list[int] = field(default_factory=list)   # frame index of each packet, in arrival order
    arrival: list[float] = field(default_factory=list)
    server_lag_ms: list[float] = field(default_factory=list)
    drained_at: float | None = None
    ended: str | None = None                          # the server's end reason ("completed", ...)
    errors: list[str] = field(default_factory=list)   # "code: message" of every error event (some are not fatal)
    error: str | None = None                          # why the call failed: refused, cut, or our own give-up
    output_sha256: str = ""


async def paced_call(http, ws_url: str, index: int, pcm: bytes, connect_at: float, origin: float,
                     seed: int) -> CallRecord:
    """Connect at connect_at, send append k at origin + k * 80 ms (later if the connection was late),
    then end_input; read every packet and event until the server closes."""
    import aiohttp

    rec = CallRecord(index, origin)
    n_frames = len(pcm) // (2 * FRAME_IN)
    await asyncio.sleep(max(0.0, connect_at - time.monotonic()))
    out = hashlib.sha256()
    try:
        async with http.ws_connect(ws_url, max_msg_size=0, autoping=True) as ws:
            await ws.send_json({"type": "start", "seed": seed, "sample_rate": 16000})
            first = await ws.receive()
            started = json.loads(first.data) if first.type == aiohttp.WSMsgType.TEXT else {}
            if started.get("type") != "started":
                rec.error = f"{started.get('code', 'refused')}: {started.get('message', first.type)}"
                return rec
            rec.origin = max(origin, time.monotonic())

            async def send():
                for k in range(n_frames):
                    await asyncio.sleep(max(0.0, rec.origin + k * FRAME_S - time.monotonic()))
                    rec.sent.append(time.monotonic())   # before the await: the server may have it before we resume
                    await ws.send_bytes(pcm[k * 2 * FRAME_IN:(k + 1) * 2 * FRAME_IN])
                await ws.send_json({"type": "end_input"})

            sender = asyncio.create_task(send())
            try:
                async for m in ws:
                    if m.type == aiohttp.WSMsgType.BINARY:
                        now = time.monotonic()
                        k = int.from_bytes(m.data[:4], "little")
                        lag = float(np.frombuffer(m.data[4:HEADER_SIZE], "<f4")[0])
                        rec.frames.append(k)
                        rec.arrival.append(now)
                        rec.server_lag_ms.append(lag)
                        out.update(m.data[HEADER_SIZE:])
                        continue
                    if m.type != aiohttp.WSMsgType.TEXT:
                        break
                    ev = json.loads(m.data)
                    if ev["type"] == "drained":
                        rec.drained_at = time.monotonic()
                    elif ev["type"] == "ended":
                        rec.ended = ev["reason"]
                    elif ev["type"] == "error":   # e.g. function_call_parse_error: the call goes on
                        rec.errors.append(f"{ev['code']}: {ev['message']}")
            finally:
                if not sender.done():
                    sender.cancel()
                elif not sender.cancelled() and sender.exception() is not None:
                    rec.error = f"send: {type(sender.exception()).__name__}: {sender.exception()}"
            if rec.ended is None and rec.error is None:   # closed without "ended": the last error ended it
                rec.error = rec.errors[-1] if rec.errors else "closed: the server closed without 'ended'"
    except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as e:
        rec.error = rec.error or f"connection: {type(e).__name__}: {e}"
    rec.output_sha256 = out.hexdigest()
    return rec


async def callers(http, ws_url: str, calls: list[tuple[int, float, float]], pcm: bytes, seed: int,
                  limit: float) -> list[CallRecord]:
    """Paced callers (index, connect_at, origin) on this event loop; one not done `limit` s after the
    first connects fails with a timeout."""
    tasks = [asyncio.create_task(paced_call(http, ws_url, i, pcm, connect_at, origin, seed))
             for i, connect_at, origin in calls]
    done, pending = await asyncio.wait(tasks, timeout=limit) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    return [task.result() if task in done and task.exception() is None else
            CallRecord(i, origin, error=f"timeout: not done {limit:.0f} s after start")
            for task, (i, _, origin) in zip(tasks, calls)]


# Real callers are separate machines, not one Python event loop taking 128 x 2 messages per 80 ms and
# timestamping them: above loadtest.callers_per_process the callers are sharded over processes, each with
# its own event loop (their times are CLOCK_MONOTONIC, shared by all), so the bench's own queueing cannot
# pass for the server's. (Measured at lockstep 128: the client-side lag exceeded the server's by 14 ms at
# p50 and 46 at p99; sharding did not close that gap, the server's event loop was the cause:
# docs/performance.md, "Through the server (load)".)
def callers_process(ws_url: str, calls: list[tuple[int, float, float]], pcm: bytes, seed: int,
                    limit: float) -> list[CallRecord]:
    import aiohttp

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            return await callers(http, ws_url, calls, pcm, seed, limit)
    return asyncio.run(main())


def caller_groups(n: int, per_process: int) -> list[list[int]]:
    """Caller indices by process: round robin, so each process has callers from the whole start spread."""
    procs = max(1, -(-n // max(1, per_process)))
    return [list(range(p, n, procs)) for p in range(procs)]


@dataclass
class UploadRecord:
    started: float
    finished: float | None = None
    frames: int = 0
    error: str | None = None


async def upload_loop(http, url: str, wav: bytes, every_s: float, until: asyncio.Event, seed: int,
                      records: list[UploadRecord]) -> None:
    """POST the WAV to /generate every `every_s` until `until` is set; each reply is read to its end."""
    async def one(rec: UploadRecord):
        try:
            async with http.post(f"{url}/generate?seed={seed}", data=wav,
                                 headers={"Content-Type": "audio/wav"}) as resp:
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return
                async for line in resp.content:
                    ev = json.loads(line)
                    if ev["type"] == "audio":
                        rec.frames += 1
                    elif ev["type"] == "error" and rec.error is None:
                        rec.error = f"{ev['code']}: {ev['message']}"
            rec.finished = time.monotonic()
        except Exception as e:  # recorded, never fatal to the run
            rec.error = rec.error or f"{type(e).__name__}: {e}"

    async def launch():
        rec = UploadRecord(time.monotonic())
        records.append(rec)
        await one(rec)
    await periodically(every_s, until, launch)


async def periodically(every_s: float, until: asyncio.Event, launch) -> None:
    """Start `launch()` every `every_s` until `until` is set; return once every started one is done."""
    tasks = []
    while not until.is_set():
        tasks.append(asyncio.create_task(launch()))
        try:
            await asyncio.wait_for(until.wait(), every_s)
        except asyncio.TimeoutError:
            pass
    await asyncio.gather(*tasks)


# =====================================================================================================
# The server's side: /metrics and the GPU
# =====================================================================================================
METRIC = re.compile(r"^(duplex_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN|\+Inf)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled duplex_* samples of a Prometheus text page (labelled ones are summed by name)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = METRIC.match(line)
        if m and not (m.group(2) and "le=" in m.group(2)):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
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
                     "gpu_memory_bytes": b.get("gpu_memory_bytes")})
    return rows


# =====================================================================================================
# Judging a run
# =====================================================================================================
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


def call_failure(rec: CallRecord, n_frames: int) -> str | None:
    """Why a call failed (None if it did not): an error, an abnormal end, or missing or misordered frames."""
    if rec.error:
        return rec.error.split(":")[0]
    if rec.ended != "completed":
        return f"ended_{rec.ended}" if rec.ended else "no_end"
    if rec.frames != list(range(n_frames)):
        return "frames_missing_or_out_of_order"
    return None


def judge(records: list[CallRecord], n_frames: int, jitter_buffer_ms: float) -> dict:
    """The latency and real-time verdict of a run's calls."""
    failures: dict[str, int] = {}
    for r in records:
        why = call_failure(r, n_frames)
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
        "frames_expected": n_frames * len(records), "frames_received": sum(len(r.frames) for r in records),
        "server_lag_ms": pct([x for r in records for x in r.server_lag_ms]),
        # the same without each call's first frame: a call with no frame yet has no rhythm for the engine's
        # coalescing, so first frames wait a step more, and in short calls they reach the top percentile
        "server_lag_after_first_ms": pct([x for r in records for k, x in zip(r.frames, r.server_lag_ms) if k > 0]),
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


# =====================================================================================================
# One run
# =====================================================================================================
def start_offsets(start: str, n: int, stagger_s: float) -> list[float]:
    if start == "lockstep":
        return [0.0] * n
    if start == "staggered":
        return [i * stagger_s / n for i in range(n)]
    raise ValueError(f"loadtest.starts: 'lockstep' or 'staggered', got {start!r}")


async def run_once(url: str, lt: DictConfig, start: str, n: int, pcm: bytes, server_pid: int | None,
                   uploads: bool, prompts=None) -> dict:
    import aiohttp

    from nemo_duplex.audio import encode_wav, from_pcm16

    n_frames = len(pcm) // (2 * FRAME_IN)
    ws_url = url.replace("http", "ws", 1).rstrip("/") + "/generate/ws"
    groups = caller_groups(n, int(lt.callers_per_process))
    pool = None
    if len(groups) > 1:  # started (and their imports done) before the schedule's clock starts
        import multiprocessing
        pool = multiprocessing.get_context("spawn").Pool(len(groups))
        pool.map(time.sleep, [0.0] * len(groups))
    t0 = time.monotonic()
    origin = t0 + float(lt.lead_s)   # connections are made before the schedule starts
    offsets = start_offsets(start, n, float(lt.stagger_s))
    samples: list[dict] = []
    upload_records: list[UploadRecord] = []
    arrival_records: list[ArrivalRecord] = []
    stop_polling, stop_uploads = asyncio.Event(), asyncio.Event()
    limit = float(lt.lead_s) + max(offsets) + n_frames * FRAME_S + float(lt.run_timeout_s)
    connector = aiohttp.TCPConnector(limit=0)   # the default pool (100) would queue callers
    async with aiohttp.ClientSession(connector=connector) as http:
        poller = asyncio.create_task(poll_server(http, url, float(lt.metrics_every_s), stop_polling, server_pid,
                                                 samples))
        uploader = None
        if uploads:
            upcm, _ = load_input(lt.clip, float(lt.upload_s))
            wav = encode_wav(from_pcm16(upcm), 16000)
            uploader = asyncio.create_task(upload_loop(http, url, wav, float(lt.upload_every_s), stop_uploads,
                                                       int(lt.seed), upload_records))
        arriver = None
        if prompts is not None:   # (started with the schedule: the live calls are admitted by then)
            apcm, _ = load_input(lt.clip, float(lt.arrival_s))

            async def arrive():
                await asyncio.sleep(max(0.0, origin - time.monotonic()))
                await arrival_loop(http, ws_url, apcm, float(lt.arrival_every_s), stop_uploads, prompts,
                                   int(lt.seed), arrival_records)
            arriver = asyncio.create_task(arrive())
        plan = [[(i, t0 + offsets[i], origin + offsets[i]) for i in group] for group in groups]
        if pool is None:
            records = await callers(http, ws_url, plan[0], pcm, int(lt.seed), limit)
        else:
            try:
                jobs = [pool.apply_async(callers_process, (ws_url, part, pcm, int(lt.seed), limit)) for part in plan]
                shares = await asyncio.gather(*(asyncio.to_thread(job.get, limit + 30) for job in jobs))
            finally:  # the jobs are done (or one failed): the idle workers go
                pool.terminate()
                pool.join()
            records = sorted((r for share in shares for r in share), key=lambda r: r.index)
        stop_uploads.set()
        for task in (uploader, arriver):
            if task is not None:
                await task
        stop_polling.set()
        await poller
    row = {"start": start, "n_calls": n, "duration_s": n_frames * FRAME_S, **judge(records, n_frames,
                                                                                   float(lt.jitter_buffer_ms))}
    tl = timeline(samples, t0)
    busy = [x for x in tl if x["step_ms"] is not None and (x["active_calls"] or 0) > 0]
    row["step_ms"] = {"mean": _mean([x["step_ms"] * x["steps"] for x in busy], [x["steps"] for x in busy]),
                      "max_interval": max((x["step_ms"] for x in busy), default=None)}
    row["batch"] = {"mean": _mean([x["batch"] * x["steps"] for x in busy], [x["steps"] for x in busy]),
                    "max_interval": max((x["batch"] for x in busy), default=None)}
    for key in ("padded_batch", "gather_ms", "prep_ms", "device_ms", "dispatch_ms"):  # where the step time went
        have = [x for x in busy if x.get(key) is not None]
        row[key] = _mean([x[key] * x["steps"] for x in have], [x["steps"] for x in have])
    mem = [s["gpu_memory_bytes"] for s in samples if s.get("gpu_memory_bytes")]
    row["gpu_memory_bytes"] = max(mem) if mem else None
    row["gpu_memory_per_call_mib"] = round(max(mem) / n / 2 ** 20, 1) if mem else None
    if uploads:
        ok = [u for u in upload_records if u.error is None and u.finished is not None]
        row["uploads"] = {"started": len(upload_records), "failed": len(upload_records) - len(ok),
                          "seconds": pct([u.finished - u.started for u in ok], (50,)),
                          "errors": sorted({u.error or "no reply" for u in upload_records if u not in ok})}
    if prompts is not None:
        ok = [a for a in arrival_records if a.error is None and a.first_packet is not None]
        row["arrivals"] = {"started": len(arrival_records), "failed": len(arrival_records) - len(ok),
                           "first_packet_ms": pct([1000 * (a.first_packet - a.started) for a in ok], (50, 99)),
                           "errors": sorted({a.error or "no packet" for a in arrival_records if a not in ok})}
    row["timeline"] = tl
    row["records"] = records
    return row


UPLOADS_START = "staggered+uploads"  # the start label of loadtest.upload_runs' runs
ARRIVALS_START = "lockstep+arrivals"  # the start label of loadtest.arrival_runs' runs


@dataclass
class ArrivalRecord:
    started: float
    first_packet: float | None = None
    finished: float | None = None
    error: str | None = None


WORDS = ("account", "address", "balance", "booking", "card", "city", "customer", "date", "delivery", "flight",
         "hotel", "invoice", "order", "payment", "policy", "refund", "reservation", "room", "schedule", "ticket")


def fresh_prompts(tokenizer, n_tokens: int, seed: int):
    """System prompts of n_tokens ids each (the BOS and EOS the server adds included), each one new."""
    import random

    rng = random.Random(seed)
    for i in __import__("itertools").count():
        words = [f"Caller {seed}-{i}. You are the agent of a travel desk; be brief."]
        while len(tokenizer.encode(" ".join(words))) < n_tokens - 2:
            words.append(f"{rng.choice(WORDS)}-{rng.randrange(10 ** 6)}")
        ids = tokenizer.encode(" ".join(words))[: n_tokens - 2]
        yield tokenizer.decode(ids)


async def arrival_loop(http, ws_url: str, pcm: bytes, every_s: float, until: asyncio.Event, prompts, seed: int,
                       records: list[ArrivalRecord]) -> None:
    """A new call every `every_s` until `until` is set: its fresh prompt, its audio at once, end_input; read
    to its end."""
    import aiohttp

    async def one(rec: ArrivalRecord, prompt: str):
        try:
            async with http.ws_connect(ws_url, max_msg_size=0) as ws:
                await ws.send_json({"type": "start", "prompt": prompt, "seed": seed})
                await ws.send_bytes(pcm)
                await ws.send_json({"type": "end_input"})
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.BINARY and rec.first_packet is None:
                        rec.first_packet = time.monotonic()
                    elif msg.type == aiohttp.WSMsgType.TEXT:
                        ev = json.loads(msg.data)
                        if ev["type"] == "error" and rec.error is None:
                            rec.error = f"{ev['code']}: {ev['message']}"
            rec.finished = time.monotonic()
        except Exception as e:  # recorded, never fatal to the run
            rec.error = rec.error or f"{type(e).__name__}: {e}"

    async def launch():
        rec = ArrivalRecord(time.monotonic())
        records.append(rec)
        await one(rec, next(prompts))
    await periodically(every_s, until, launch)


def record_run(out: Path, rows: list[dict], row: dict, meta: dict, run) -> None:
    """Keep a finished run: its packets, the results files (rewritten), W&B, one line on stdout."""
    save_calls(out, row)
    rows.append(row)
    write_results(out, rows, meta)
    if run is not None:
        run.log(wandb_scalars(row))
    s = row["server_lag_ms"]
    extra = ""
    if "uploads" in row:
        extra = f", uploads {row['uploads']['started'] - row['uploads']['failed']}/{row['uploads']['started']} done"
    if row.get("lag_p99_vs_without_uploads") is not None:
        extra += f", lag p99 {row['lag_p99_vs_without_uploads']}x the run without"
    if "arrivals" in row:
        a = row["arrivals"]
        extra = (f", arrivals {a['started'] - a['failed']}/{a['started']} admitted, first packet p50/p99 "
                 f"{a['first_packet_ms'].get('p50')}/{a['first_packet_ms'].get('p99')} ms")
    if row.get("lag_p99_vs_without_arrivals") is not None:
        extra += f", live lag p99 {row['lag_p99_vs_without_arrivals']}x the run without"
    print(f"{row['start']:>9} N={row['n_calls']:<4} real time {'yes' if row['real_time'] else 'NO '} failed "
          f"{row['failed_calls']} lag p50/p99 {s['p50']}/{s['p99']} ms, lateness p99 "
          f"{row['lateness_ms']['p99']} ms, step {row['step_ms']['mean']} ms, batch {row['batch']['mean']}{extra}",
          flush=True)


def _mean(weighted: list[float], weights: list[float]) -> float | None:
    return round(sum(weighted) / sum(weights), 3) if weights and sum(weights) else None


# =====================================================================================================
# The server under test
# =====================================================================================================
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """scripts/serve.py in a subprocess with this run's model and engine overrides; stopped by its pid."""

    def __init__(self, overrides: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, str(REPO / "scripts" / "serve.py"), *overrides, "serve.host=127.0.0.1",
               f"serve.port={self.port}", f"hydra.run.dir={log_path.parent / 'server'}"]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "w")
        self._log.write(" ".join(cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)

    def wait_ready(self, timeout_s: float) -> None:
        import urllib.error
        import urllib.request

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}) before it was ready:\n"
                                   + self.log_path.read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server was not ready after loadtest.startup_timeout_s = {timeout_s:g} s; "
                           f"log: {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)   # aiohttp shuts down cleanly on SIGINT
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


# the server's limits for a sweep are the load test's to set (its largest N, loadtest.max_call_s)
SET_BY_THE_LOAD_TEST = ("engine.max_calls", "engine.max_call_s")


def server_overrides(cfg: DictConfig, task_overrides: list[str], max_calls: int) -> list[str]:
    """The bench's own model/engine/device/sampling overrides, plus the server's limits for this sweep."""
    lt = cfg.loadtest
    keep = [o for o in task_overrides if o.lstrip("+~").split("=")[0].split(".")[0]
            not in ("loadtest", "wandb", "hydra")]
    given = [k for k in SET_BY_THE_LOAD_TEST if k in {o.lstrip("+~").split("=")[0] for o in keep}]
    if given:
        raise runtime.SettingsError(f"{', '.join(given)}: the load test sets the server's limits itself "
                                    "(loadtest.n_calls, loadtest.extra_calls, loadtest.max_call_s)")
    return keep + [f"engine.max_calls={max_calls}", f"engine.max_call_s={float(lt.max_call_s)}",
                   f"serve.max_upload_s={float(lt.max_call_s)}", *[str(x) for x in lt.server_args]]


async def wait_idle(url: str, timeout_s: float) -> None:
    """Until the server holds no call (the previous run's slots are back)."""
    import aiohttp

    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - t0 < timeout_s:
            async with http.get(f"{url}/metrics") as r:
                m = parse_metrics(await r.text())
            if m.get("duplex_active_calls", 0) == 0 and m.get("duplex_sessions", 0) == 0:
                return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"the server still holds calls {timeout_s:g} s after the run")


# =====================================================================================================
# Reporting
# =====================================================================================================
def _uploads_mode(meta: dict) -> str:
    if meta["uploads"]:
        return "on in every run"
    runs = meta.get("upload_runs") or []
    return f"in one more staggered run at N = {', '.join(map(str, runs))}" if runs else "off"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"input sha256 {meta['input_sha256'][:16]}, {meta['duration_s']:g} s per call, jitter buffer "
             f"{meta['jitter_buffer_ms']:g} ms, uploads {_uploads_mode(meta)}; server: "
             f"{' '.join(meta['server_overrides']) or meta['url']}", "",
             "| start | N | real time | failed | server lag p50 / p95 / p99 ms | p99 after frame 0 | lateness p99 ms "
             "| late pkts "
             "| first audio p50 ms | drain p50 ms | step ms (mean / max) | gather + prep / device / dispatch ms "
             "| batch / padded (mean) | GPU MiB/call |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---|---|---|---:|"]
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"   # noqa: E731
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['start']} | {r['n_calls']} | skipped: {r['skipped']} |" + " |" * 11)
            continue
        s = r["server_lag_ms"]
        lines.append(
            f"| {r['start']} | {r['n_calls']} | {'yes' if r['real_time'] else 'NO'} | {r['failed_calls']} | "
            f"{f(s['p50'])} / {f(s['p95'])} / {f(s['p99'])} | {f(r.get('server_lag_after_first_ms', {}).get('p99'))} | "
            f"{f(r['lateness_ms']['p99'])} | {r['late_packets']} | "
            f"{f(r['first_packet_ms']['p50'])} | {f(r['drain_ms']['p50'])} | "
            f"{f(r['step_ms']['mean'])} / {f(r['step_ms']['max_interval'])} | "
            f"{f(r.get('gather_ms'))} + {f(r.get('prep_ms'))} / {f(r.get('device_ms'))} / {f(r.get('dispatch_ms'))} | "
            f"{f(r['batch']['mean'])} / {f(r.get('padded_batch'))} | {f(r['gpu_memory_per_call_mib'])} |")
    lines += ["", "Sustained (largest N with every N' <= N real time): "
              + ", ".join(f"{k} {v}" for k, v in sustained([r for r in rows if not r.get("skipped")]).items())]
    for r in rows:
        if "uploads" in r:
            u = r["uploads"]
            ratio = r.get("lag_p99_vs_without_uploads")
            lines.append(f"Uploads in the {r['start']} run at N={r['n_calls']}: {u['started']} started, {u['failed']} "
                         f"failed, median {u['seconds'].get('p50') if u['seconds'] else '-'} s each"
                         + (f"; live lag p99 {ratio}x the same N without uploads" if ratio is not None else ""))
        if "arrivals" in r:
            a = r["arrivals"]
            ratio = r.get("lag_p99_vs_without_arrivals")
            lines.append(f"Arrivals in the {r['start']} run at N={r['n_calls']}: {a['started']} started, {a['failed']} "
                         f"failed, first packet p50 / p99 {a['first_packet_ms'].get('p50')} / "
                         f"{a['first_packet_ms'].get('p99')} ms"
                         + (f"; live lag p99 {ratio}x the same N without arrivals" if ratio is not None else "")
                         + (f"; errors: {a['errors']}" if a["errors"] else ""))
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if not r.get("skipped")]
    starts = list(dict.fromkeys(r["start"] for r in done))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, start in enumerate(starts):
        rs = sorted((r for r in done if r["start"] == start), key=lambda r: r["n_calls"])
        n = [r["n_calls"] for r in rs]
        for q, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
            ax.plot(n, [r["server_lag_ms"][q] for r in rs], style, color=f"C{i}", marker="o", label=f"{start} {q}")
    ax.axhline(FRAME_S * 1000, color="grey", lw=0.8, label="one frame (80 ms)")
    ax.set(xlabel="concurrent calls N", ylabel="server lag per frame (ms)", yscale="log",
           title="Per-frame server lag vs N")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "lag_vs_n.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, start in enumerate(starts):
        rs = sorted((r for r in done if r["start"] == start), key=lambda r: r["n_calls"])
        n = [r["n_calls"] for r in rs]
        ax.plot(n, [r["step_ms"]["mean"] for r in rs], "-", color=f"C{i}", marker="o", label=f"{start} mean")
        ax.plot(n, [r["step_ms"]["max_interval"] for r in rs], "--", color=f"C{i}", marker="x",
                label=f"{start} worst interval")
    ax.axhline(FRAME_S * 1000, color="red", lw=0.8, label="real-time budget (80 ms)")
    ax.set(xlabel="concurrent calls N", ylabel="batched step time (ms)", title="Step time vs N")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "step_vs_n.png", dpi=120)
    plt.close(fig)


def write_results(out: Path, rows: list[dict], meta: dict) -> None:
    summary = [{k: v for k, v in r.items() if k != "records"} for r in rows]
    result = {**meta, "sustained": sustained([r for r in rows if not r.get("skipped")]), "runs": summary}
    (out / "load.json").write_text(json.dumps(result, indent=1))
    (out / "summary.md").write_text(markdown(rows, meta) + "\n")


def save_calls(out: Path, row: dict) -> None:
    """Every packet of every call of a run: frame, arrival and send time (s from the call's origin), server lag."""
    calls = []
    for r in row["records"]:
        calls.append({"index": r.index, "error": r.error, "errors": r.errors, "ended": r.ended,
                      "output_sha256": r.output_sha256,
                      "sent_s": [round(s - r.origin, 5) for s in r.sent],
                      "frames": r.frames, "arrival_s": [round(a - r.origin, 5) for a in r.arrival],
                      "server_lag_ms": [round(x, 3) for x in r.server_lag_ms],
                      "drained_s": None if r.drained_at is None else round(r.drained_at - r.origin, 5)})
    (out / "calls").mkdir(exist_ok=True)
    (out / "calls" / f"{row['start']}_{row['n_calls']}.json").write_text(json.dumps(calls))


def wandb_run(cfg: DictConfig, out: Path, meta: dict):
    if cfg.wandb.mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        print(f"wandb is not installed: no W&B run (wandb.mode={cfg.wandb.mode}); the results are in {out}", flush=True)
        return None
    return wandb.init(project=cfg.wandb.project, mode=cfg.wandb.mode, dir=str(out), job_type="load",
                      config={"loadtest": OmegaConf.to_container(cfg.loadtest, resolve=True), **meta})


def wandb_scalars(row: dict) -> dict:
    flat = {"n_calls": row["n_calls"], "real_time": int(row["real_time"]), "failed_calls": row["failed_calls"],
            "late_packets": row["late_packets"], "step_ms_mean": row["step_ms"]["mean"],
            "batch_mean": row["batch"]["mean"]}
    for q, v in row["server_lag_ms"].items():
        flat[f"server_lag_ms_{q}"] = v
    for q, v in row["server_lag_after_first_ms"].items():
        flat[f"server_lag_after_first_ms_{q}"] = v
    for q, v in row["lateness_ms"].items():
        flat[f"lateness_ms_{q}"] = v
    return {f"{row['start']}/{k}": v for k, v in flat.items()}


# =====================================================================================================
# The sweep
# =====================================================================================================
def output_dir(cfg: DictConfig) -> Path:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if cfg.loadtest.out:
        out = Path(cfg.loadtest.out)
    elif os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / (f"load_{hc.job.num}" if hc.mode == RunMode.MULTIRUN else "load")
    else:
        out = Path(hc.runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


@hydra.main(config_path="../conf", config_name="bench", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from nemo_duplex.serving.memory import bytes_per_call

    lt = cfg.loadtest
    began = time.monotonic()
    out = output_dir(cfg)
    sizes = sorted(int(n) for n in lt.n_calls)
    pcm, digest = load_input(lt.clip, float(lt.duration_s))
    upload_runs = sorted(int(n) for n in (lt.upload_runs or []))
    arrival_runs = sorted(int(n) for n in (lt.arrival_runs or []))
    any_uploads = bool(lt.uploads) or bool(upload_runs) or bool(arrival_runs)
    longest = max(float(lt.duration_s), float(lt.upload_s) if (lt.uploads or upload_runs) else 0.0,
                  float(lt.arrival_s) if arrival_runs else 0.0)
    if float(lt.max_call_s) < longest + 1:
        raise SystemExit(f"loadtest.max_call_s = {lt.max_call_s} must exceed the calls (duration_s "
                         f"{lt.duration_s}, upload_s {lt.upload_s}, arrival_s {lt.arrival_s}) by a second")
    server = None
    overrides: list[str] = []
    url = lt.url
    task = list(HydraConfig.get().overrides.task)
    with runtime.refusals("bench"):
        if url is None:
            max_calls = max(sizes + upload_runs + arrival_runs) + (int(lt.extra_calls) if any_uploads else 0)
            overrides = server_overrides(cfg, task, max_calls)
            resolved = runtime.resolve_model(cfg)   # fails here, before a server starts, without a checkpoint
            model_cfg = resolved.cfg
            print(runtime.summary(cfg, resolved, "bench (the server it starts)"), flush=True)
            runtime.write_settings(out, cfg, resolved)
        else:
            ignored = [o for o in task if o.lstrip("+~").split("=")[0].split(".")[0].split("/")[0]
                       not in ("loadtest", "wandb", "hydra")]
            if ignored:
                raise runtime.SettingsError(f"{' '.join(ignored)}: loadtest.url={url} is a running server, whose "
                                            "settings are its own")
            model_cfg = None
    prompts = None
    if arrival_runs:
        if model_cfg is None or cfg.model.weights != "random":
            raise SystemExit("loadtest.arrival_runs makes its prompts with the server's tokenizer: it needs the "
                             "server started here with model.weights=random (not loadtest.url)")
        from nemo_duplex.checkpoint.random_weights import make_tokenizer_for

        prompts = fresh_prompts(make_tokenizer_for(model_cfg), int(lt.arrival_prompt_tokens), int(lt.seed))
    if url is None:
        server = ServerProcess(overrides, out / "server.log")
        print(f"starting the server: {' '.join(overrides)}", flush=True)
    meta = {"url": url or "", "server_overrides": overrides, "input_sha256": digest,
            "duration_s": len(pcm) / 2 / 16000, "jitter_buffer_ms": float(lt.jitter_buffer_ms),
            "uploads": bool(lt.uploads), "upload_runs": upload_runs,
            "planned_state_bytes_per_call": (bytes_per_call(model_cfg, float(lt.max_call_s)).total
                                             if model_cfg is not None else None),
            "server_max_call_s": float(lt.max_call_s)}
    rows: list[dict] = []
    run = None
    try:
        if server is not None:
            t = time.monotonic()
            server.wait_ready(float(lt.startup_timeout_s))
            url = server.url
            meta["server_ready_s"] = round(time.monotonic() - t, 1)
            print(f"server ready in {meta['server_ready_s']:.0f} s at {url}", flush=True)
        run = wandb_run(cfg, out, meta)
        for start in lt.starts:
            late_seen = False
            for n in sizes:
                expected = float(lt.lead_s) + float(lt.stagger_s) + len(pcm) / 2 / 16000 + 5.0
                if late_seen and lt.stop_when_late:
                    rows.append({"start": start, "n_calls": n, "skipped": "a smaller N was not real time"})
                    continue
                if time.monotonic() - began + expected > float(lt.time_budget_s):
                    rows.append({"start": start, "n_calls": n, "skipped": "loadtest.time_budget_s"})
                    continue
                asyncio.run(wait_idle(url, 60.0))
                row = asyncio.run(run_once(url, lt, start, n, pcm, server.proc.pid if server else None,
                                           bool(lt.uploads)))
                late_seen = late_seen or not row["real_time"]
                record_run(out, rows, row, meta, run)
        for n in upload_runs:  # the same server, N staggered calls again, now beside the uploads
            if time.monotonic() - began + float(lt.stagger_s) + len(pcm) / 2 / 16000 + 10.0 > float(lt.time_budget_s):
                rows.append({"start": UPLOADS_START, "n_calls": n, "skipped": "loadtest.time_budget_s"})
                continue
            asyncio.run(wait_idle(url, 60.0))
            row = asyncio.run(run_once(url, lt, "staggered", n, pcm, server.proc.pid if server else None, True))
            row["start"] = UPLOADS_START
            without = [r for r in rows if r["start"] == "staggered" and r["n_calls"] == n and not r.get("skipped")]
            if without and without[0]["server_lag_ms"]["p99"] and row["server_lag_ms"]["p99"] is not None:
                row["lag_p99_vs_without_uploads"] = round(row["server_lag_ms"]["p99"]
                                                          / without[0]["server_lag_ms"]["p99"], 3)
            record_run(out, rows, row, meta, run)
        for n in arrival_runs:  # the same server, N lockstep calls again, new calls arriving beside them
            if time.monotonic() - began + len(pcm) / 2 / 16000 + 15.0 > float(lt.time_budget_s):
                rows.append({"start": ARRIVALS_START, "n_calls": n, "skipped": "loadtest.time_budget_s"})
                continue
            asyncio.run(wait_idle(url, 60.0))
            row = asyncio.run(run_once(url, lt, "lockstep", n, pcm, server.proc.pid if server else None, False,
                                       prompts))
            row["start"] = ARRIVALS_START
            without = [r for r in rows if r["start"] == "lockstep" and r["n_calls"] == n and not r.get("skipped")]
            if without and without[0]["server_lag_ms"]["p99"] and row["server_lag_ms"]["p99"] is not None:
                row["lag_p99_vs_without_arrivals"] = round(row["server_lag_ms"]["p99"]
                                                           / without[0]["server_lag_ms"]["p99"], 3)
            record_run(out, rows, row, meta, run)
    finally:
        if server is not None:
            server.stop()
        write_results(out, rows, meta)
        if lt.plots and any(not r.get("skipped") for r in rows):
            try:
                plot(rows, out)
            except ImportError as e:   # results are written already; plots are a convenience
                print(f"no plots: {e}", flush=True)
        if run is not None:
            run.finish()
    print("\n" + markdown(rows, meta) + f"\n\nresults: {out}", flush=True)


if __name__ == "__main__":
    main()
