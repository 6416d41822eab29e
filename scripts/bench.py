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
append at a time on an absolute schedule (append k leaves at origin + k * 80 ms), then end_input. With
loadtest.length_mix=[lo,hi] the calls differ in length: caller i sends the first L_i seconds of that input
(the clip looped to hi), L_i drawn uniform in [lo, hi] from loadtest.seed and rounded up to whole frames,
and declares L_i plus one frame as its max_call_s; each run records its calls' lengths. The
callers start together ("lockstep") or spread over loadtest.stagger_s ("staggered"); optionally a
loadtest.upload_s WAV is POSTed to /generate every loadtest.upload_every_s, sharing the GPU: in every run
(loadtest.uploads=true), or after the sweep in one more staggered run per N of loadtest.upload_runs on the
same server ("staggered+uploads"), whose lag p99 is compared with the sweep's staggered run of that N.
loadtest.arrival_runs=[N]: after the sweep, N lockstep calls again while new calls arrive every
loadtest.arrival_every_s, each with a fresh system prompt of loadtest.arrival_prompt_tokens tokens (never
seen before: no prefix cache hit) and loadtest.arrival_s of audio sent at once ("lockstep+arrivals"); the
live calls' lag p99 is compared with the sweep's lockstep run of that N, and each arrival's time to its first
packet (its admission) is recorded. The prompts are made with the server's tokenizer (model.weights=random).
An upload or arrival the server never ends is cut after its audio + loadtest.run_timeout_s (its error kept).

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
  stalled         the longest the server reported a step or an admission under way past engine.max_step_s /
                  engine.max_admission_s (duplex_stalled_seconds); said in the summary when not 0
The sustained count of a start mode is the largest N such that every N' <= N of the sweep was real time.
Results: load.json (rewritten after every run), calls/<start>_<N>.json (every packet's arrival),
summary.md, lag_vs_n.png, step_vs_n.png under loadtest.out (default $OUT or the Hydra run directory),
and W&B (wandb.mode, offline by default).

This file is the sweep, one run of it and the server under test; the callers, the /metrics sampling, the
judging and the results files are in nemo_duplex/loadtest/.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_duplex import runtime, settings  # noqa: E402
from nemo_duplex.loadtest.callers import (  # noqa: E402
    FRAME_IN,
    FRAME_S,
    ArrivalRecord,
    CallPlan,
    UploadRecord,
    arrival_loop,
    caller_groups,
    callers,
    callers_process,
    check_length_mix,
    declared_max_call_s,
    fresh_prompts,
    mixed_lengths,
    upload_loop,
    whole_frames,
)
from nemo_duplex.loadtest.judging import ARRIVALS_START, UPLOADS_START, judge, pct  # noqa: E402
from nemo_duplex.loadtest.metrics import admission_pieces, parse_metrics, poll_server, timeline  # noqa: E402
from nemo_duplex.loadtest.report import (  # noqa: E402
    markdown,
    plot,
    save_calls,
    stalls_said,
    wandb_run,
    wandb_scalars,
    write_results,
)

REPO = Path(__file__).resolve().parent.parent
settings.register()


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
    mix = lt.length_mix is not None
    # each caller's length in frames: with a length mix its own draw (it sends that much of the input, which
    # is as long as the longest call can be), else the whole input
    lengths = mixed_lengths(lt.length_mix, n, int(lt.seed)) if mix else [n_frames] * n
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
    limit = float(lt.lead_s) + max(offsets) + max(lengths) * FRAME_S + float(lt.run_timeout_s)
    connector = aiohttp.TCPConnector(limit=0)   # the default pool (100) would queue callers
    async with aiohttp.ClientSession(connector=connector) as http:
        poller = asyncio.create_task(poll_server(http, url, float(lt.metrics_every_s), stop_polling, server_pid,
                                                 samples))
        uploader = None
        if uploads:
            upcm, _ = load_input(lt.clip, float(lt.upload_s))
            wav = encode_wav(from_pcm16(upcm), 16000)
            uploader = asyncio.create_task(upload_loop(http, url, wav, float(lt.upload_every_s), stop_uploads,
                                                       int(lt.seed), upload_records,
                                                       float(lt.upload_s) + float(lt.run_timeout_s)))
        arriver = None
        if prompts is not None:   # (started with the schedule: the live calls are admitted by then)
            apcm, _ = load_input(lt.clip, float(lt.arrival_s))

            async def arrive():
                await asyncio.sleep(max(0.0, origin - time.monotonic()))
                await arrival_loop(http, ws_url, apcm, float(lt.arrival_every_s), stop_uploads, prompts,
                                   int(lt.seed), arrival_records, float(lt.arrival_s) + float(lt.run_timeout_s))
            arriver = asyncio.create_task(arrive())
        plan = [[CallPlan(i, t0 + offsets[i], origin + offsets[i], lengths[i],
                          declared_max_call_s(lengths[i]) if mix else None) for i in group] for group in groups]
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
    if mix:
        seconds = [k * FRAME_S for k in lengths]
        length = {"length_s": {"min": round(min(seconds), 3), "mean": round(sum(seconds) / n, 3),
                               "max": round(max(seconds), 3)},
                  "lengths_s": [round(x, 3) for x in seconds]}   # by caller index; each declared one frame more
    else:
        length = {"duration_s": n_frames * FRAME_S}
    row = {"start": start, "n_calls": n, **length, **judge(records, float(lt.jitter_buffer_ms))}
    tl = timeline(samples, t0)
    busy = [x for x in tl if x["step_ms"] is not None and (x["active_calls"] or 0) > 0]
    row["step_ms"] = {"mean": _mean([x["step_ms"] * x["steps"] for x in busy], [x["steps"] for x in busy]),
                      "max_interval": max((x["step_ms"] for x in busy), default=None)}
    row["batch"] = {"mean": _mean([x["batch"] * x["steps"] for x in busy], [x["steps"] for x in busy]),
                    "max_interval": max((x["batch"] for x in busy), default=None)}
    for key in ("padded_batch", "gather_ms", "prep_ms", "device_ms", "dispatch_ms"):  # where the step time went
        have = [x for x in busy if x.get(key) is not None]
        row[key] = _mean([x[key] * x["steps"] for x in have], [x["steps"] for x in have])
    # the longest the server reported a step or an admission under way past its bound (0: never)
    row["stalled_s"] = {part: max((x[f"stalled_{part}_s"] for x in tl), default=0.0) for part in ("engine", "admission")}
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
                           # x real time, first packet to last (its audio came in at once: a backlog)
                           "catch_up_x": pct([x for a in ok if (x := a.catch_up()) is not None], (0, 50)),
                           "errors": sorted({a.error or "no packet" for a in arrival_records if a not in ok}),
                           "pieces": admission_pieces(samples)}
    row["timeline"] = tl
    row["records"] = records
    return row


def record_run(out: Path, rows: list[dict], row: dict, meta: dict, run) -> None:
    """Keep a finished run: its packets, the results files (rewritten), W&B, one line on stdout."""
    save_calls(out, row)
    rows.append(row)
    write_results(out, rows, meta)
    if run is not None:
        run.log(wandb_scalars(row))
    s = row["server_lag_ms"]
    extra = ""
    if "length_s" in row:
        length = row["length_s"]
        extra = f", call lengths min/mean/max {length['min']}/{length['mean']}/{length['max']} s"
    if "uploads" in row:
        extra += f", uploads {row['uploads']['started'] - row['uploads']['failed']}/{row['uploads']['started']} done"
    if row.get("lag_p99_vs_without_uploads") is not None:
        extra += f", lag p99 {row['lag_p99_vs_without_uploads']}x the run without"
    if "arrivals" in row:
        a = row["arrivals"]
        extra += (f", arrivals {a['started'] - a['failed']}/{a['started']} admitted, first packet p50/p99 "
                  f"{a['first_packet_ms'].get('p50')}/{a['first_packet_ms'].get('p99')} ms, catch-up min/p50 "
                  f"{a['catch_up_x'].get('p0')}/{a['catch_up_x'].get('p50')}x real time")
    if row.get("lag_p99_vs_without_arrivals") is not None:
        extra += f", live lag p99 {row['lag_p99_vs_without_arrivals']}x the run without"
    if stalls := stalls_said(row):
        extra += f", SERVER STALLED: {stalls}"
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
    if lt.length_mix is None:
        calls_s, input_s, calls = float(lt.duration_s), float(lt.duration_s), f"duration_s {lt.duration_s}"
    else:
        try:
            _, calls_s = check_length_mix(lt.length_mix, float(lt.max_call_s))
        except ValueError as e:
            raise SystemExit(str(e)) from None
        # the input is as long as the longest call can be; each caller sends a prefix of it
        input_s, calls = whole_frames(calls_s) * FRAME_S, f"length_mix {list(lt.length_mix)}"
    pcm, digest = load_input(lt.clip, input_s)
    upload_runs = sorted(int(n) for n in (lt.upload_runs or []))
    arrival_runs = sorted(int(n) for n in (lt.arrival_runs or []))
    any_uploads = bool(lt.uploads) or bool(upload_runs) or bool(arrival_runs)
    longest = max(calls_s, float(lt.upload_s) if (lt.uploads or upload_runs) else 0.0,
                  float(lt.arrival_s) if arrival_runs else 0.0)
    if float(lt.max_call_s) < longest + 1:
        raise SystemExit(f"loadtest.max_call_s = {lt.max_call_s} must exceed the calls ({calls}, upload_s "
                         f"{lt.upload_s}, arrival_s {lt.arrival_s}) by a second")
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
    if lt.length_mix is not None:   # the input (input_sha256, duration_s) is then the longest call's
        meta["length_mix"] = [float(x) for x in lt.length_mix]
        meta["length_seed"] = int(lt.seed)
    rows: list[dict] = []
    run = None
    # a SIGTERM (a job's time limit, `timeout`) ends the bench through `finally`: its server goes with it
    # and what was measured is written, rather than the server living on beside the next run
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
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
        # then, on the same server, N calls again with load beside them: uploads beside N staggered calls
        # (loadtest.upload_runs), new calls arriving beside N lockstep ones (loadtest.arrival_runs); each is
        # compared with the sweep's run of that start mode and N
        beside = [(UPLOADS_START, "staggered", n, float(lt.stagger_s) + 10.0, True, None, "lag_p99_vs_without_uploads")
                  for n in upload_runs]
        beside += [(ARRIVALS_START, "lockstep", n, 15.0, False, prompts, "lag_p99_vs_without_arrivals")
                   for n in arrival_runs]
        for label, start, n, margin_s, uploads, run_prompts, ratio_key in beside:
            if time.monotonic() - began + len(pcm) / 2 / 16000 + margin_s > float(lt.time_budget_s):
                rows.append({"start": label, "n_calls": n, "skipped": "loadtest.time_budget_s"})
                continue
            asyncio.run(wait_idle(url, 60.0))
            row = asyncio.run(run_once(url, lt, start, n, pcm, server.proc.pid if server else None, uploads,
                                       run_prompts))
            row["start"] = label
            without = [r for r in rows if r["start"] == start and r["n_calls"] == n and not r.get("skipped")]
            if without and without[0]["server_lag_ms"]["p99"] and row["server_lag_ms"]["p99"] is not None:
                row[ratio_key] = round(row["server_lag_ms"]["p99"] / without[0]["server_lag_ms"]["p99"], 3)
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
