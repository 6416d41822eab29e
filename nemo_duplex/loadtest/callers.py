"""The load of scripts/bench.py: paced callers over the native protocol (/generate/ws, binary PCM both ways),
one 80 ms append at a time on an absolute schedule, sharded over processes when there are many; and beside
them, in the background, WAV uploads to /generate and newly arriving calls with fresh system prompts.
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np

FRAME_S = 0.08
FRAME_IN = 1280   # 16 kHz input samples per frame
HEADER_SIZE = 8   # <I frame, <f server lag ms (docs/protocol.md)


@dataclass
class CallPlan:
    """One caller of a run: when it connects, when its append 0 is due, how many 80 ms frames of the input it
    sends, and the max_call_s it declares in its opening (None: none, the server's limit holds)."""
    index: int
    connect_at: float
    origin: float
    n_frames: int
    max_call_s: float | None = None


def check_length_mix(length_mix, max_call_s: float) -> tuple[float, float]:
    """loadtest.length_mix -> (lo, hi) seconds, or ValueError naming the rule it breaks: 0 < lo <= hi, and the
    longest call a second under loadtest.max_call_s (the server's engine.max_call_s), as for duration_s."""
    try:
        lo, hi = (float(x) for x in length_mix)
    except (TypeError, ValueError):
        raise ValueError(f"loadtest.length_mix = {length_mix}: [lo, hi] in seconds") from None
    if not 0 < lo <= hi:
        raise ValueError(f"loadtest.length_mix = [{lo:g}, {hi:g}]: needs 0 < lo <= hi")
    if not hi + 1 <= max_call_s:
        raise ValueError(f"loadtest.length_mix = [{lo:g}, {hi:g}]: hi must be a second under loadtest.max_call_s "
                         f"= {max_call_s:g} (the server's engine.max_call_s)")
    return lo, hi


def whole_frames(seconds: float) -> int:
    """Seconds of input rounded up to whole 80 ms frames (a length that is whole frames in decimal stays so)."""
    return max(1, math.ceil(round(seconds / FRAME_S, 6)))


def mixed_lengths(length_mix, n: int, seed: int) -> list[int]:
    """loadtest.length_mix: the n callers' input lengths in frames, drawn uniform in [lo, hi] seconds by a
    numpy Generator seeded with `seed` and rounded up to whole frames. Caller i's is the i-th draw, so it
    has the same length at every N."""
    lo, hi = (float(x) for x in length_mix)
    return [whole_frames(x) for x in np.random.default_rng(seed).uniform(lo, hi, size=n)]


def declared_max_call_s(n_frames: int) -> float:
    """The max_call_s a caller of n_frames declares: its length plus one frame of slack, so that no rounding
    of the limit into frames can end the call before its last frame."""
    return round((n_frames + 1) * FRAME_S, 6)


@dataclass
class CallRecord:
    """What one caller saw. Times are monotonic seconds of this process."""
    index: int
    origin: float                                     # when append 0 was due
    n_frames: int = 0                                 # the frames it was to send (its length)
    sent: list[float] = field(default_factory=list)   # append k left at sent[k]
    frames: list[int] = field(default_factory=list)   # frame index of each packet, in arrival order
    arrival: list[float] = field(default_factory=list)
    server_lag_ms: list[float] = field(default_factory=list)
    drained_at: float | None = None
    ended: str | None = None                          # the server's end reason ("completed", ...)
    errors: list[str] = field(default_factory=list)   # "code: message" of every error event (some are not fatal)
    error: str | None = None                          # why the call failed: refused, cut, or our own give-up
    output_sha256: str = ""


async def paced_call(http, ws_url: str, plan: CallPlan, pcm: bytes, seed: int) -> CallRecord:
    """Connect at plan.connect_at, send append k (of the input's first plan.n_frames frames) at plan.origin
    + k * 80 ms (later if the connection was late), then end_input; read every packet and event until the
    server closes."""
    import aiohttp

    rec = CallRecord(plan.index, plan.origin, plan.n_frames)
    n_frames = plan.n_frames
    await asyncio.sleep(max(0.0, plan.connect_at - time.monotonic()))
    out = hashlib.sha256()
    opening = {"type": "start", "seed": seed, "sample_rate": 16000}
    if plan.max_call_s is not None:
        opening["max_call_s"] = plan.max_call_s
    try:
        async with http.ws_connect(ws_url, max_msg_size=0, autoping=True) as ws:
            await ws.send_json(opening)
            first = await ws.receive()
            started = json.loads(first.data) if first.type == aiohttp.WSMsgType.TEXT else {}
            if started.get("type") != "started":
                rec.error = f"{started.get('code', 'refused')}: {started.get('message', first.type)}"
                return rec
            rec.origin = max(plan.origin, time.monotonic())

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


async def callers(http, ws_url: str, calls: list[CallPlan], pcm: bytes, seed: int,
                  limit: float) -> list[CallRecord]:
    """Paced callers on this event loop; one not done `limit` s after the first connects fails with a
    timeout."""
    tasks = [asyncio.create_task(paced_call(http, ws_url, plan, pcm, seed)) for plan in calls]
    done, pending = await asyncio.wait(tasks, timeout=limit) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    return [task.result() if task in done and task.exception() is None else
            CallRecord(plan.index, plan.origin, plan.n_frames, error=f"timeout: not done {limit:.0f} s after start")
            for task, plan in zip(tasks, calls)]


# Real callers are separate machines, not one Python event loop taking 128 x 2 messages per 80 ms and
# timestamping them: above loadtest.callers_per_process the callers are sharded over processes, each with
# its own event loop (their times are CLOCK_MONOTONIC, shared by all), so the bench's own queueing cannot
# pass for the server's. (Measured at lockstep 128: the client-side lag exceeded the server's by 14 ms at
# p50 and 46 at p99; sharding did not close that gap, the server's event loop was the cause:
# docs/performance.md, "Through the server (load)".)
def callers_process(ws_url: str, calls: list[CallPlan], pcm: bytes, seed: int,
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


@dataclass
class ArrivalRecord:
    started: float
    first_packet: float | None = None
    last_packet: float | None = None
    packets: int = 0
    finished: float | None = None
    error: str | None = None

    def catch_up(self, frame_s: float = 0.08) -> float | None:
        """Audio out per second of wall time from the first packet to the last: how much faster than real
        time an arrival whose audio came in at once (a backlog) was served; None under 2 packets."""
        if self.packets < 2 or self.last_packet == self.first_packet:
            return None
        return (self.packets - 1) * frame_s / (self.last_packet - self.first_packet)


async def periodically(every_s: float, until: asyncio.Event, records: list, new_record, request,
                       timeout_s: float) -> None:
    """One more request every `every_s` until `until` is set; returns once every started one is done. Each
    has its record, `new_record(start time)`, appended to `records`; `await request(record)` returns whether
    the reply was read to its end (`finished` is then that time); an exception it raises is kept in `error`,
    and a request not done within `timeout_s` is cut with that as its error (a server that never ends a
    request must not hang the run)."""
    async def launch():
        rec = new_record(time.monotonic())
        records.append(rec)
        try:
            if await asyncio.wait_for(request(rec), timeout_s):
                rec.finished = time.monotonic()
        except asyncio.TimeoutError:
            rec.error = rec.error or f"not done {timeout_s:g} s after it started (loadtest.run_timeout_s)"
        except Exception as e:  # recorded, never fatal to the run
            rec.error = rec.error or f"{type(e).__name__}: {e}"

    tasks = []
    while not until.is_set():
        tasks.append(asyncio.create_task(launch()))
        try:
            await asyncio.wait_for(until.wait(), every_s)
        except asyncio.TimeoutError:
            pass
    await asyncio.gather(*tasks)


async def upload_loop(http, url: str, wav: bytes, every_s: float, until: asyncio.Event, seed: int,
                      records: list[UploadRecord], timeout_s: float) -> None:
    """POST the WAV to /generate every `every_s` until `until` is set; each reply is read to its end, or cut
    after `timeout_s`."""
    async def upload(rec: UploadRecord) -> bool:
        async with http.post(f"{url}/generate?seed={seed}", data=wav, headers={"Content-Type": "audio/wav"}) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return False
            async for line in resp.content:
                ev = json.loads(line)
                if ev["type"] == "audio":
                    rec.frames += 1
                elif ev["type"] == "error" and rec.error is None:
                    rec.error = f"{ev['code']}: {ev['message']}"
        return True

    await periodically(every_s, until, records, UploadRecord, upload, timeout_s)


WORDS = ("account", "address", "balance", "booking", "card", "city", "customer", "date", "delivery", "flight",
         "hotel", "invoice", "order", "payment", "policy", "refund", "reservation", "room", "schedule", "ticket")


def fresh_prompts(tokenizer, n_tokens: int, seed: int):
    """System prompts of n_tokens ids each (the BOS and EOS the server adds included), each one new."""
    rng = random.Random(seed)
    for i in itertools.count():
        words = [f"Caller {seed}-{i}. You are the agent of a travel desk; be brief."]
        while len(tokenizer.encode(" ".join(words))) < n_tokens - 2:
            words.append(f"{rng.choice(WORDS)}-{rng.randrange(10 ** 6)}")
        ids = tokenizer.encode(" ".join(words))[: n_tokens - 2]
        yield tokenizer.decode(ids)


async def arrival_loop(http, ws_url: str, pcm: bytes, every_s: float, until: asyncio.Event, prompts, seed: int,
                       records: list[ArrivalRecord], timeout_s: float) -> None:
    """A new call every `every_s` until `until` is set: its fresh prompt, its audio at once, end_input; read
    to its end, or cut after `timeout_s`."""
    import aiohttp

    async def arrive(rec: ArrivalRecord) -> bool:
        prompt = next(prompts)
        async with http.ws_connect(ws_url, max_msg_size=0) as ws:
            await ws.send_json({"type": "start", "prompt": prompt, "seed": seed})
            await ws.send_bytes(pcm)
            await ws.send_json({"type": "end_input"})
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY:
                    rec.last_packet = time.monotonic()
                    rec.first_packet = rec.first_packet or rec.last_packet
                    rec.packets += 1
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    ev = json.loads(msg.data)
                    if ev["type"] == "error" and rec.error is None:
                        rec.error = f"{ev['code']}: {ev['message']}"
        return True

    await periodically(every_s, until, records, ArrivalRecord, arrive, timeout_s)
