"""scripts/bench.py: the load test end to end against a tiny-model server it starts itself (2 calls,
lockstep and staggered), and its judging (nemo_duplex/loadtest/) on made-up arrival times."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nemo_duplex.loadtest.callers import (
    CallRecord,
    caller_groups,
    check_length_mix,
    declared_max_call_s,
    mixed_lengths,
    whole_frames,
)
from nemo_duplex.loadtest.judging import judge, sustained
from nemo_duplex.loadtest.metrics import admission_pieces, parse_metrics, timeline

REPO = Path(__file__).resolve().parent.parent
FRAME_MS = 80.0


def record(arrivals_ms, frames=None, ended="completed", error=None, lag_ms=10.0, n_frames=None):
    """A call of n_frames (default: as many as arrived) whose append k left at k * 80 ms and whose packets
    arrived at arrivals_ms."""
    frames = list(range(len(arrivals_ms))) if frames is None else frames
    n = len(arrivals_ms)
    return CallRecord(0, 0.0, n if n_frames is None else n_frames, sent=[k * FRAME_MS / 1000 for k in range(n)],
                      frames=frames, arrival=[a / 1000 for a in arrivals_ms], server_lag_ms=[lag_ms] * n,
                      drained_at=(arrivals_ms[-1] + 5) / 1000 if arrivals_ms else None, ended=ended, error=error)


# ---- judging -------------------------------------------------------------------------------------------
def test_steady_calls_are_real_time_even_with_a_large_constant_delay():
    on_time = record([50 + k * FRAME_MS for k in range(20)])
    delayed = record([400 + k * FRAME_MS for k in range(20)])   # a constant delay never underruns a buffer
    v = judge([on_time, delayed], 160.0)
    assert v["real_time"] and v["failed_calls"] == 0 and v["late_packets"] == 0
    assert v["lateness_ms"]["max"] == pytest.approx(-160.0, abs=1e-6)
    assert v["client_lag_ms"]["p50"] == pytest.approx(225.0, abs=1e-6)   # half at 50 ms, half at 400 ms
    assert v["first_packet_ms"]["max"] == pytest.approx(400.0, abs=1e-6)


def test_lag_after_the_first_frame_leaves_out_only_frame_0():
    """server_lag_after_first_ms: every packet's server lag but each call's frame 0 (whose wait for the first
    step is no rhythm's), by frame index, so a reordered or missing frame 0 does not shift it."""
    a = record([50 + k * FRAME_MS for k in range(4)])
    a.server_lag_ms = [90.0, 10.0, 20.0, 30.0]
    b = record([60 + k * FRAME_MS for k in range(3)], frames=[1, 0, 2], n_frames=4)
    b.server_lag_ms = [40.0, 95.0, 50.0]
    v = judge([a, b], 160.0)
    assert v["server_lag_ms"]["max"] == pytest.approx(95.0)
    assert v["server_lag_after_first_ms"]["max"] == pytest.approx(50.0)
    assert v["server_lag_after_first_ms"]["p50"] == pytest.approx(30.0)   # of 10, 20, 30, 40, 50


def test_lag_after_2s_leaves_out_each_calls_first_25_frames():
    """server_lag_after_2s_ms: the steady state, each call's frames from 2 s (frame 25) on, by frame index: a
    burst of admissions at the start (high lag in the first frames) shows in server_lag_ms, not here."""
    a = record([50 + k * FRAME_MS for k in range(30)])
    a.server_lag_ms = [900.0] * 25 + [10.0, 20.0, 30.0, 40.0, 50.0]
    order = list(range(30))[::-1]
    b = record([60 + k * FRAME_MS for k in range(30)], frames=order, n_frames=30)
    b.server_lag_ms = [60.0 if k >= 25 else 800.0 for k in order]
    v = judge([a, b], 1e6)
    assert v["server_lag_ms"]["max"] == pytest.approx(900.0)
    assert v["server_lag_after_2s_ms"]["max"] == pytest.approx(60.0)
    assert v["server_lag_after_2s_ms"]["p50"] == pytest.approx(55.0)   # of 10, 20, 30, 40, 50 and 60 x 5


def test_a_packet_later_than_the_jitter_buffer_is_an_underrun():
    arrivals = [50 + k * FRAME_MS for k in range(20)]
    arrivals[10] += 170.0            # 10 ms past its playback slot
    ok = judge([record(arrivals)], 180.0)
    late = judge([record(arrivals)], 160.0)
    assert ok["real_time"] and ok["late_packets"] == 0
    assert not late["real_time"] and late["late_packets"] == 1 and late["calls_with_late_packets"] == 1
    assert late["lateness_ms"]["max"] == pytest.approx(10.0, abs=1e-6)


def test_failed_calls_are_named():
    good = [50 + k * FRAME_MS for k in range(10)]
    survived = record(good)
    survived.errors.append("function_call_parse_error: the model's tool call did not parse")   # not fatal
    v = judge([survived, record(good[:9], n_frames=10), record(good, ended="limit"),
               record(good, error="busy: all 2 call places are taken")], 160.0)
    assert not v["real_time"] and v["failed_calls"] == 3
    assert v["failures"] == {"frames_missing_or_out_of_order": 1, "ended_limit": 1, "busy": 1}
    assert v["error_events"] == {"function_call_parse_error": 1}
    assert judge([survived], 160.0)["real_time"]


def test_sustained_is_the_largest_n_below_the_first_failure():
    rows = [{"start": "lockstep", "n_calls": n, "real_time": ok}
            for n, ok in ((16, False), (1, True), (8, True), (32, True))]
    rows += [{"start": "staggered", "n_calls": 1, "real_time": False}]
    assert sustained(rows) == {"lockstep": 8, "staggered": 0}


def test_calls_of_different_lengths_are_judged_each_over_its_own_frames():
    """loadtest.length_mix: a 5-frame and a 12-frame call that both completed in full are real time; a call
    is short of frames against its own length, not the run's longest."""
    short = record([50 + k * FRAME_MS for k in range(5)])
    long = record([60 + k * FRAME_MS for k in range(12)])
    v = judge([short, long], 160.0)
    assert v["real_time"] and v["failed_calls"] == 0
    assert v["frames_expected"] == v["frames_received"] == 17
    cut = record([50 + k * FRAME_MS for k in range(4)], n_frames=5)   # its last frame never came
    v = judge([cut, long], 160.0)
    assert v["failures"] == {"frames_missing_or_out_of_order": 1} and v["frames_expected"] == 17
    assert v["frames_received"] == 16 and not v["real_time"]


def test_length_mix_draw_is_seeded_per_caller_in_whole_frames():
    """Caller i's length is the i-th uniform draw in [lo, hi] of numpy's Generator seeded by loadtest.seed,
    rounded up to whole 80 ms frames: the same at every N and on every run, another seed another mix. It
    declares one frame more as its max_call_s."""
    lengths = mixed_lengths([1.0, 3.0], 64, 0)
    assert lengths == mixed_lengths([1.0, 3.0], 64, 0) != mixed_lengths([1.0, 3.0], 64, 1)
    assert mixed_lengths([1.0, 3.0], 8, 0) == lengths[:8]
    drawn = np.random.default_rng(0).uniform(1.0, 3.0, 64)
    assert lengths == [int(np.ceil(x / 0.08)) for x in drawn]
    assert all(13 <= k <= 38 for k in lengths) and len(set(lengths)) > 10   # 1 s is 12.5 frames, 3 s 37.5
    assert whole_frames(0.24) == 3 and whole_frames(0.2401) == 4 and whole_frames(3.0) == 38
    assert mixed_lengths([2.4, 2.4], 3, 5) == [30, 30, 30]                # a mix of one length
    assert declared_max_call_s(30) == 2.48 and declared_max_call_s(1) == 0.16


@pytest.mark.parametrize("mix,max_call_s,why", [
    ([0.0, 3.0], 10.0, "0 < lo <= hi"),
    ([-1.0, 3.0], 10.0, "0 < lo <= hi"),
    ([3.0, 2.0], 10.0, "0 < lo <= hi"),
    ([float("nan"), 2.0], 10.0, "0 < lo <= hi"),
    ([1.0, 9.5], 10.0, "a second under loadtest.max_call_s = 10"),
    ([1.0], 10.0, "[lo, hi]"),
    ([1.0, 2.0, 3.0], 10.0, "[lo, hi]"),
    (["a", 2.0], 10.0, "[lo, hi]"),
])
def test_length_mix_is_checked(mix, max_call_s, why):
    with pytest.raises(ValueError, match="loadtest.length_mix") as e:
        check_length_mix(mix, max_call_s)
    assert why in str(e.value)


def test_a_length_mix_up_to_a_second_under_max_call_s_is_taken():
    assert check_length_mix([1, 9], 10.0) == (1.0, 9.0)
    assert check_length_mix([2.5, 2.5], 10.0) == (2.5, 2.5)


def test_caller_groups_shard_round_robin():
    assert caller_groups(2, 32) == [[0, 1]]          # one process: the callers run in the bench's own
    assert caller_groups(5, 2) == [[0, 3], [1, 4], [2]]
    assert caller_groups(128, 32) == [list(range(p, 128, 4)) for p in range(4)]
    assert sorted(i for g in caller_groups(97, 32) for i in g) == list(range(97))


def test_parse_metrics_and_timeline():
    page = ("# HELP duplex_steps_total x\nduplex_steps_total 10.0\nduplex_frames_total 25.0\n"
            "duplex_step_seconds_sum 0.5\nduplex_step_seconds_bucket{le=\"0.1\"} 9.0\n"
            "duplex_refusals_total{reason=\"busy\"} 2.0\nduplex_refusals_total{reason=\"x\"} 1.0\n"
            "duplex_active_calls 3.0\n"
            "duplex_stalled_seconds{part=\"engine\"} 0.0\nduplex_stalled_seconds{part=\"admission\"} 31.5\n")
    m = parse_metrics(page)
    # the stall gauge is kept per part (the other labelled ones are summed)
    assert m == {"duplex_steps_total": 10.0, "duplex_frames_total": 25.0, "duplex_step_seconds_sum": 0.5,
                 "duplex_refusals_total": 3.0, "duplex_active_calls": 3.0, "duplex_stalled_seconds:engine": 0.0,
                 "duplex_stalled_seconds:admission": 31.5}
    a = {"t": 1.0, "duplex_steps_total": 10.0, "duplex_frames_total": 25.0, "duplex_step_seconds_sum": 0.5,
         "duplex_step_device_seconds_total": 0.3, "duplex_padded_rows_total": 40.0}
    b = {"t": 2.0, "duplex_steps_total": 14.0, "duplex_frames_total": 37.0, "duplex_step_seconds_sum": 0.7,
         "duplex_step_device_seconds_total": 0.46, "duplex_padded_rows_total": 56.0, "duplex_active_calls": 3.0}
    (row,) = timeline([a, b | {"duplex_stalled_seconds:admission": 31.5}], 0.0)
    assert row["stalled_admission_s"] == 31.5 and row["stalled_engine_s"] == 0.0
    assert row["step_ms"] == pytest.approx(50.0) and row["batch"] == pytest.approx(3.0)
    assert row["device_ms"] == pytest.approx(40.0) and row["padded_batch"] == pytest.approx(4.0)
    assert row["prep_ms"] == 0.0   # not on the page: counted as nothing
    assert row["frames_per_s"] == pytest.approx(12.0)
    # the admission thread's pieces, per start, over the run (first sample to last)
    pieces = 'duplex_admission_pieces_total{start="gap"} 7.0\nduplex_admission_pieces_total{start="waited"} 2.0\n'
    first, last = parse_metrics(pieces), parse_metrics(pieces.replace("7.0", "19.0"))
    assert last == {"duplex_admission_pieces_total:gap": 19.0, "duplex_admission_pieces_total:waited": 2.0}
    assert admission_pieces([first, a, last]) == {"gap": 12, "waited": 0} and admission_pieces([first]) == {}


# ---- end to end ----------------------------------------------------------------------------------------
def test_two_calls_lockstep_and_staggered_through_a_server_it_starts(tmp_path):
    out = tmp_path / "load"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(REPO / "scripts/bench.py"), "model.weights=random",
                        "loadtest.n_calls=[2]", "loadtest.starts=[lockstep,staggered]", "loadtest.duration_s=1.2",
                        "loadtest.stagger_s=0.5", "loadtest.lead_s=0.5", "loadtest.max_call_s=5",
                        # then the staggered run again beside uploads, on the same server
                        "loadtest.upload_runs=[2]", "loadtest.upload_s=1.2", "loadtest.upload_every_s=0.6",
                        # 3 slots for uploads: one every 0.6 s, each 1.2 s of audio, so two overlap in real
                        # time and a third when the CPU runs them slower than that (on this 2-core machine they
                        # sometimes do, and the full server then refused the third: "failed 1")
                        "loadtest.extra_calls=3",
                        # every caller in a process of its own: the sharded path (scripts/bench.py)
                        "loadtest.callers_per_process=1",
                        "wandb.mode=offline", f"loadtest.out={out}", f"hydra.run.dir={tmp_path / 'hydra'}"],
                       capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "load.json").read_text())
    # the W&B run (offline: written beside the results, no network)
    assert len(list((out / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    n_frames = 15   # 1.2 s of 80 ms frames
    assert result["duration_s"] == pytest.approx(1.2)
    assert len(result["input_sha256"]) == 64
    assert [(x["start"], x["n_calls"]) for x in result["runs"]] == [("lockstep", 2), ("staggered", 2),
                                                                     ("staggered+uploads", 2)]
    with_uploads = result["runs"][2]
    assert with_uploads["uploads"]["started"] >= 1 and with_uploads["uploads"]["failed"] == 0, with_uploads["uploads"]
    assert with_uploads["uploads"]["errors"] == []
    assert with_uploads["lag_p99_vs_without_uploads"] == pytest.approx(
        with_uploads["server_lag_ms"]["p99"] / result["runs"][1]["server_lag_ms"]["p99"], rel=1e-2)
    assert set(result["sustained"]) == {"lockstep", "staggered"}   # the uploads run is not part of the sweep
    assert "Uploads in the staggered+uploads run at N=2: " in (out / "summary.md").read_text()
    for run in result["runs"]:
        assert run["failed_calls"] == 0, run["failures"]
        assert run["frames_expected"] == run["frames_received"] == 2 * n_frames
        for key in ("server_lag_ms", "server_lag_after_first_ms", "client_lag_ms", "lateness_ms"):
            assert all(run[key][q] is not None for q in ("p50", "p95", "p99", "max")), key
        assert "server_lag_after_2s_ms" in run   # (None where calls are shorter than 2 s)
        assert run["drain_ms"]["p50"] is not None and run["first_packet_ms"]["p50"] is not None
        # an upload is one more row of the batch while it runs (at most loadtest.extra_calls at a time)
        assert run["step_ms"]["mean"] > 0 and 1.0 <= run["batch"]["mean"] <= 2.0 + 3 * ("uploads" in run)
        # the phases are parts of the step (eager on the CPU: no padding)
        assert run["device_ms"] > 0 and run["prep_ms"] > 0 and run["dispatch_ms"] >= 0 and run["gather_ms"] >= 0
        assert run["prep_ms"] + run["device_ms"] + run["dispatch_ms"] <= run["step_ms"]["mean"] * 1.05 + 1
        assert run["padded_batch"] == pytest.approx(run["batch"]["mean"], rel=1e-3)
        assert run["timeline"] and all("step_ms" in t and "batch" in t for t in run["timeline"])

        # every packet, recomputed from the per-call file: the verdict follows from the arrivals
        calls = json.loads((out / "calls" / f"{run['start']}_2.json").read_text())
        assert len(calls) == 2
        late = 0
        for c in calls:
            assert c["frames"] == list(range(n_frames)) and c["ended"] == "completed"
            arr, sent, lag = np.array(c["arrival_s"]), np.array(c["sent_s"]), np.array(c["server_lag_ms"])
            lateness = (arr - arr[0] - np.arange(n_frames) * 0.08) * 1000 - result["jitter_buffer_ms"]
            late += int((lateness > 0).sum())
            # the server's lag sits inside the client's: received after we sent, sent before we got it
            # (1 ms: the header's float32 and the rounding of the saved times)
            assert np.all(lag <= (arr - sent) * 1000 + 1.0)
            assert np.all(lag >= 0)
        assert late == run["late_packets"]
        assert run["real_time"] == (late == 0)

    assert result["sustained"] == sustained(result["runs"])
    # the server never stalled; had it, the summary says so
    assert all(run["stalled_s"] == {"engine": 0.0, "admission": 0.0} for run in result["runs"])
    from nemo_duplex.loadtest.report import markdown
    assert "stalled" not in markdown(result["runs"], result)
    result["runs"][0]["stalled_s"]["admission"] = 31.5
    assert ("The server stalled in the lockstep run at N=2: admission under way 32 s"
            in markdown(result["runs"], result))
    assert (out / "lag_vs_n.png").stat().st_size > 0 and (out / "step_vs_n.png").stat().st_size > 0
    assert "Sustained" in (out / "summary.md").read_text()
    assert "starting the server" in r.stdout


def test_arrival_catch_up_is_audio_out_per_wall_second():
    """An arrival whose 2 s of audio came in at once: 25 packets, the first at 0.5 s and the last 0.6 s
    later = 24 frames of 80 ms in 0.6 s, 3.2x real time; under 2 packets there is no rate."""
    from nemo_duplex.loadtest.callers import ArrivalRecord

    rec = ArrivalRecord(started=0.0, first_packet=0.5, last_packet=1.1, packets=25)
    assert rec.catch_up() == pytest.approx(3.2)
    assert ArrivalRecord(started=0.0, first_packet=0.5, last_packet=0.5, packets=1).catch_up() is None


def test_a_request_the_server_never_ends_is_cut_and_the_loop_returns():
    """periodically: one request hangs, the other answers; the loop returns after the hanging one's
    timeout with its error named, instead of waiting for it forever."""
    import asyncio

    from nemo_duplex.loadtest.callers import ArrivalRecord, periodically

    async def run():
        records, until = [], asyncio.Event()

        async def request(rec):
            if len(records) == 1:
                await asyncio.Event().wait()   # a server that never ends this one
            return True

        async def stop_soon():
            await asyncio.sleep(0.15)
            until.set()

        stopper = asyncio.create_task(stop_soon())
        await asyncio.wait_for(periodically(0.1, until, records, ArrivalRecord, request, timeout_s=0.5), 5.0)
        await stopper
        return records

    records = asyncio.run(run())
    assert len(records) == 2
    assert records[0].finished is None and "not done 0.5 s after it started" in records[0].error
    assert records[1].finished is not None and records[1].error is None


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d.name))
    return kids


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_stops_the_bench_and_the_server_it_started(tmp_path):
    """A bench ended by SIGTERM (a job's time limit) stops its server too, and writes what it has."""
    import signal
    import time

    out, log = tmp_path / "load", tmp_path / "bench.out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, str(REPO / "scripts/bench.py"), "model.weights=random",
                                 "loadtest.n_calls=[1]", "loadtest.duration_s=60", "loadtest.max_call_s=70",
                                 "wandb.mode=disabled", f"loadtest.out={out}", f"hydra.run.dir={tmp_path / 'hydra'}"],
                                stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.poll() is None and "server ready" not in log.read_text():
            time.sleep(0.5)
        servers = _children(proc.pid)
        assert len(servers) == 1 and _running(servers[0])
        time.sleep(2.0)   # the run under way
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert not _running(servers[0])   # stopped by the bench, not left running beside the next one
    assert json.loads((out / "load.json").read_text())["runs"] == []
