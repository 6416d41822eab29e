"""A call outlives a lost connection (server/resume.py): its client reconnects with the call's resume token and
the number of messages it received, and gets exactly the rest. Over real loopback sockets on the scripted
server (tests/server_support.py: each packet holds its frame index and the call's seed), so every frame can be
checked to arrive once, in order, whichever connection carried it. One file past 500 lines on purpose: every
rule of a lost connection (which closes park a call, what a resume gives back and refuses, racing resumes, the
idle clock, shutdown, both routes and scripts/call.py) over one client helper."""
from __future__ import annotations

import asyncio
import json
import struct
import time

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from nemo_duplex.server.errors import Refusal
from nemo_duplex.server.resume import CallConnections, Parking, SentLog
from nemo_duplex.server.ws import CallConnection
from tests.server_support import NATIVE, ScriptedModel, b64, frames_of, tone

FRAME_IN = 1280
SEED = 3


class Client:
    """One WebSocket connection that keeps every message it receives, in order (text parsed as JSON, binary as
    bytes), and can lose its transport the way a network does: a reset, no close frame."""

    def __init__(self, ws):
        self.ws, self.got = ws, []

    @classmethod
    async def open(cls, url: str, headers: dict | None = None) -> "Client":
        return cls(await connect(url, max_size=None, ping_interval=None, additional_headers=headers))

    async def take(self, until, timeout: float = 20.0) -> None:
        """Receive until `until(self.got)` holds."""
        async def run():
            while not until(self.got):
                data = await self.ws.recv()
                self.got.append(json.loads(data) if isinstance(data, str) else data)
        await asyncio.wait_for(run(), timeout)

    async def to_end(self, timeout: float = 20.0) -> int:
        """Receive until the server closes; -> its close code."""
        try:
            await self.take(lambda got: False, timeout)
        except ConnectionClosed:
            pass
        return self.ws.close_code

    def lose(self) -> None:
        self.ws.transport.abort()


def audio_frames(got) -> list[np.ndarray]:
    return frames_of([m for m in got if isinstance(m, dict)])


def realtime_packets(got) -> list[tuple[int, int]]:
    """(frame index, seed) of each audio packet received, in order."""
    return [(int(p[0]), int(p[1])) for p in audio_frames(got)]


def without_ids(events) -> list:
    """The events as a client reads them, less their ids (fresh per connection or call)."""
    drop = ("event_id", "item_id", "response_id", "id", "previous_item_id", "call_id")

    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if k not in drop and k != "resume"}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x
    return [clean(e) for e in events]


async def appends(client: Client, audio: np.ndarray) -> None:
    for i in range(0, audio.size, FRAME_IN):
        await client.ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(audio[i:i + FRAME_IN])}))


async def realtime_open(url: str, query: str = "", headers: dict | None = None) -> tuple[Client, str]:
    """A Realtime call at the model's own rates and seed SEED; -> (client, resume token)."""
    c = await Client.open(f"{url}/v1/realtime{query}", headers)
    await c.ws.send(json.dumps({"type": "session.update", "session": {**NATIVE, "seed": SEED}}))
    await c.take(lambda got: len(got) >= 2)
    assert [e["type"] for e in c.got] == ["session.created", "session.updated"]
    return c, c.got[0]["session"].get("resume", {}).get("token")


def refused(error: BaseException) -> tuple[int, dict]:
    """An upgrade refused before the handshake: (HTTP status, the JSON body)."""
    assert isinstance(error, InvalidStatus), repr(error)
    return error.response.status_code, json.loads(error.response.body)


async def wait_for(predicate, timeout: float = 10.0) -> None:
    async def run():
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(run(), timeout)


# ---- the pieces --------------------------------------------------------------------------------------------
def test_sent_log_gives_back_what_was_not_received_and_refuses_what_it_no_longer_holds():
    log = SentLog(max_bytes=10)
    for data in ("aaaa", b"bbbb", "cc", "dddd"):   # 14 bytes: the first falls out
        log.record(data)
    assert log.sent == 4 and log.first_kept == 2
    assert log.after(4) == [] and log.after(2) == ["cc", "dddd"] and log.after(1) == [b"bbbb", "cc", "dddd"]
    with pytest.raises(Refusal) as gap:
        log.after(0)
    assert gap.value.code == "resume_gap" and gap.value.status == 409 and "serve.resume_buffer_kb" in gap.value.message
    with pytest.raises(Refusal) as ahead:
        log.after(5)
    assert ahead.value.code == "invalid_resume" and "sent 4" in ahead.value.message
    big = SentLog(max_bytes=1)
    big.record("x" * 100)       # the newest is kept whatever its size
    assert big.after(0) == ["x" * 100]


def test_parking_ends_a_call_not_taken_back_within_its_grace():
    async def go():
        ended = []
        parking = Parking(0.05, ended.append)
        parking.register("kept", "A")
        parking.register("lost", "B")
        parking.park("kept")
        parking.park("lost")
        assert parking.parked == 2
        assert parking.take("kept") == "A"
        parking.unpark("kept")          # a new connection serves it
        await asyncio.sleep(0.15)
        assert ended == ["B"] and parking.parked == 0 and "kept" in parking.live and "lost" not in parking.live
        with pytest.raises(Refusal) as unknown:
            parking.take("lost")
        assert unknown.value.code == "unknown_resume_token" and unknown.value.status == 404
        parking.park("kept")
        parking.expire_all()
        assert ended == ["B", "A"] and not parking.live
    asyncio.run(go())


def test_a_connection_overtaken_during_its_upgrade_serves_nothing():
    """Two resumes of one call: the first is still upgrading when the second claims the call. The first must not
    then serve it beside the second (two writers would split the call's messages between two sockets)."""
    class Bridge:
        attached = 0

        def attach(self, cut):
            self.attached += 1

        def detach(self):
            pass

    session = CallConnection(Bridge())
    first = session.claim()
    session.claim()   # the second resume
    assert asyncio.run(session.serve(None, [], first)) is False
    assert session.bridge.attached == 0 and session.idle.is_set()


@pytest.mark.parametrize("setting", [{"resume_grace_s": -1.0}, {"resume_buffer_kb": 0}])
def test_impossible_resume_settings_are_refused_naming_them(setting):
    from types import SimpleNamespace

    from nemo_duplex.runtime import SettingsError
    from nemo_duplex.settings import ServeConfig

    with pytest.raises(SettingsError) as e:
        CallConnections(SimpleNamespace(cfg=ServeConfig(**setting), metrics=None))
    name, value = next(iter(setting.items()))
    assert f"serve.{name} = {value:g}" in str(e.value)


# ---- Realtime ----------------------------------------------------------------------------------------------
def reference_call(url: str, audio: np.ndarray) -> list[dict]:
    """The same call on one connection that is never lost."""
    async def go():
        c, _ = await realtime_open(url)
        await appends(c, audio)
        await c.ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        assert await c.to_end() == 1000
        return c.got
    return asyncio.run(go())


@pytest.mark.parametrize("how", ["reset", "half_open"])
def test_a_realtime_call_resumed_after_its_connection_is_lost_misses_nothing(server, how):
    """reset: the client's transport is reset (the server sees it go) and the client comes back; half_open:
    the client comes back while the server still holds the old connection (it has not noticed yet), which is
    cut. Either way the call goes on: the frames stepped while no connection was there, and the messages the
    old connection took but never delivered, come on the new one; every frame exactly once and in order, and
    the whole call reads as the same call on one connection, event for event."""
    srv, _ = server(resume_grace_s=30)
    first, second = tone(0.8, seed=1), tone(0.4, seed=2)
    frames = (first.size + second.size) // FRAME_IN

    async def go():
        c, token = await realtime_open(srv.ws_url)
        assert token and len(token) >= 32
        await appends(c, first)
        await c.take(lambda got: len(audio_frames(got)) >= 3)
        received = list(c.got)
        if how == "reset":
            c.lose()
            await wait_for(lambda: srv.server.call_connections.parking.parked == 1)
        again = await Client.open(f"{srv.ws_url}/v1/realtime?resume={token}&received={len(received)}")
        await appends(again, second)
        await again.ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        code = await again.to_end()
        if how == "half_open":   # the old connection was cut by the server
            await c.to_end(timeout=5)
        return received, again.got, code

    received, resumed, code = asyncio.run(go())
    whole = received + resumed
    assert code == 1000 and whole[-1]["type"] == "session.closed"
    assert realtime_packets(whole) == [(k, SEED) for k in range(frames)]   # each frame once, in order
    assert all(int(p[2]) > 0 for p in audio_frames(whole))                 # every frame heard its input
    assert not [e for e in whole if e["type"] == "error"]
    srv.wait_idle()
    assert srv.server.metrics.resumes.labels("resumed")._value.get() == 1
    assert without_ids(whole) == without_ids(reference_call(srv.ws_url, np.concatenate([first, second])))


def test_of_resumes_racing_for_one_call_only_the_last_serves_it(server):
    """Three reconnects of one call at once (a client retrying fast): each claims the call in turn and cuts the
    one before; those overtaken are refused or closed (having sent at most the start of the replay), and the
    last serves the call to its end, from the count it gave."""
    srv, _ = server(resume_grace_s=30)

    async def go():
        c, token = await realtime_open(srv.ws_url)
        await appends(c, tone(0.4))
        await c.take(lambda got: len(audio_frames(got)) >= 2)
        received = list(c.got)
        c.lose()
        await wait_for(lambda: srv.server.call_connections.parking.parked == 1)
        url = f"{srv.ws_url}/v1/realtime?resume={token}&received={len(received)}"
        tries = await asyncio.gather(*(Client.open(url) for _ in range(3)), return_exceptions=True)
        opened = [t for t in tries if isinstance(t, Client)]
        refusals = [refused(t)[0] for t in tries if not isinstance(t, Client)]
        live = []
        for t in opened:   # the overtaken ones are closed by the server
            try:
                await t.take(lambda got: False, timeout=1.5)
            except ConnectionClosed:
                continue
            except TimeoutError:
                live.append(t)
        assert len(live) == 1, (len(opened), refusals)
        (winner,) = live
        await winner.ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        code = await winner.to_end()
        return received + winner.got, code, refusals

    whole, code, refusals = asyncio.run(go())
    assert all(status == 404 for status in refusals)
    assert code == 1000 and realtime_packets(whole) == [(k, SEED) for k in range(5)]
    srv.wait_idle()


def test_a_call_that_ends_while_parked_is_delivered_whole_on_resume(server):
    """The input ended and the connection went before the last frames came back: the engine finishes the call
    meanwhile, and the client that comes back gets the rest, the end and a normal close."""
    srv, _ = server(resume_grace_s=30, model=ScriptedModel(step_s=0.05))   # 0.5 s of steps after the loss
    audio = tone(0.8)

    async def go():
        c, token = await realtime_open(srv.ws_url)
        await appends(c, audio)
        await c.ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        await c.take(lambda got: len(audio_frames(got)) >= 1)
        received = list(c.got)
        c.lose()
        await wait_for(lambda: srv.server.call_connections.parking.parked == 1)
        await wait_for(lambda: srv.server.engine.active_calls == 0)   # the call ended with no connection
        assert len(srv.server.sessions) == 1                           # its place waits for the client
        again = await Client.open(f"{srv.ws_url}/v1/realtime?resume={token}&received={len(received)}")
        code = await again.to_end()
        return received + again.got, code

    whole, code = asyncio.run(go())
    assert code == 1000 and whole[-1] == {**whole[-1], "type": "session.closed", "reason": "completed"}
    assert realtime_packets(whole) == [(k, SEED) for k in range(audio.size // FRAME_IN)]
    srv.wait_idle()


def test_a_lost_call_not_taken_back_ends_and_frees_its_place(server):
    srv, _ = server(resume_grace_s=0.3)

    async def go():
        c, token = await realtime_open(srv.ws_url)
        await appends(c, tone(0.4))
        await c.take(lambda got: len(audio_frames(got)) >= 1)
        c.lose()
        await wait_for(lambda: srv.server.call_connections.parking.parked == 1, timeout=5)
        await wait_for(lambda: not srv.server.sessions, timeout=5)   # the grace ran out: a hang-up
        with pytest.raises(InvalidStatus) as late:
            await connect(f"{srv.ws_url}/v1/realtime?resume={token}&received=3")
        return refused(late.value)

    status, body = asyncio.run(go())
    assert status == 404 and body["code"] == "unknown_resume_token" and "serve.resume_grace_s = 0.3" in body["message"]
    srv.wait_idle()
    assert srv.server.metrics.resumes.labels("expired")._value.get() == 1
    assert srv.server.metrics.calls_ended.labels("hangup")._value.get() == 1


@pytest.mark.parametrize("code", [1000, 1001, 4000])
def test_a_close_frame_is_a_hang_up_whatever_its_code(server, code):
    """Only a transport lost without a close frame parks a call: a client that closes, with any code, hung up."""
    srv, _ = server(resume_grace_s=30)

    async def go():
        c, token = await realtime_open(srv.ws_url)
        await appends(c, tone(0.4))
        await c.take(lambda got: len(audio_frames(got)) >= 1)
        await c.ws.close(code)
        await wait_for(lambda: not srv.server.sessions, timeout=5)
        assert srv.server.call_connections.parking.parked == 0
        with pytest.raises(InvalidStatus) as after:
            await connect(f"{srv.ws_url}/v1/realtime?resume={token}&received=0")
        return refused(after.value)

    status, body = asyncio.run(go())
    assert status == 404 and body["code"] == "unknown_resume_token"
    srv.wait_idle()


def test_resumes_that_cannot_be_honoured_are_refused_before_the_upgrade_and_the_call_waits_on(server):
    """Each refusal names what is wrong, and none takes the call: it is still there for a right resume."""
    srv, _ = server(resume_grace_s=30, resume_buffer_kb=4)   # an audio delta at 22.05 kHz is ~4.9 KB: only it is kept

    async def go():
        c, token = await realtime_open(srv.ws_url)
        await appends(c, tone(0.24))
        await c.take(lambda got: len(audio_frames(got)) == 3)   # every frame so far: nothing more is on its way
        n = len(c.got)
        c.lose()
        await wait_for(lambda: srv.server.call_connections.parking.parked == 1)
        answers = {}
        for name, query in [("no count", f"resume={token}"), ("not a count", f"resume={token}&received=-1"),
                            ("a digit that is not a count", f"resume={token}&received=%C2%B2"),   # '²'.isdigit()
                            ("more than sent", f"resume={token}&received={n + 1}"),
                            ("gone", f"resume={token}&received={n - 2}"), ("no token", "resume=&received=0"),
                            ("other protocol", f"resume={token}&received={n}")]:
            path = "/generate/ws" if name == "other protocol" else "/v1/realtime"
            with pytest.raises(InvalidStatus) as e:
                await connect(f"{srv.ws_url}{path}?{query}")
            answers[name] = refused(e.value)
        assert srv.server.call_connections.parking.parked == 1   # none of them took the call
        again = await Client.open(f"{srv.ws_url}/v1/realtime?resume={token}&received={n}")
        await appends(again, tone(0.16, seed=1))
        await again.ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        code = await again.to_end()
        return answers, c.got + again.got, code

    answers, whole, code = asyncio.run(go())
    assert {k: (s, b["code"]) for k, (s, b) in answers.items()} == {
        "no count": (400, "invalid_resume"), "not a count": (400, "invalid_resume"),
        "a digit that is not a count": (400, "invalid_resume"),
        "more than sent": (400, "invalid_resume"), "gone": (409, "resume_gap"),
        "no token": (404, "unknown_resume_token"), "other protocol": (404, "unknown_resume_token")}
    assert "serve.resume_buffer_kb = 4" in answers["gone"][1]["message"]
    assert "/v1/realtime" in answers["other protocol"][1]["message"]
    assert code == 1000 and realtime_packets(whole) == [(k, SEED) for k in range(5)]
    srv.wait_idle()


def test_a_client_that_stops_answering_pings_is_parked_and_one_the_server_closes_is_not(server):
    """uvicorn's keepalive: a client whose transport stopped (it answers no ping) is a lost connection, its call
    parked for a resume. A connection the server itself closes (a message over serve.max_message_kb: 1009) is
    over: its call ends at once."""
    srv, _ = server(resume_grace_s=30, max_message_kb=8)
    srv.uvicorn.config.ws_ping_interval = srv.uvicorn.config.ws_ping_timeout = 0.2   # (read by each connection)

    async def go():
        c, token = await realtime_open(srv.ws_url)
        await appends(c, tone(0.24))
        await c.take(lambda got: len(audio_frames(got)) == 3)
        c.ws.transport.pause_reading()   # half-open: the server's pings go unanswered
        await wait_for(lambda: srv.server.call_connections.parking.parked == 1, timeout=5)
        again = await Client.open(f"{srv.ws_url}/v1/realtime?resume={token}&received={len(c.got)}")
        await again.ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        resumed_code = await again.to_end()

        big, _ = await realtime_open(srv.ws_url)
        await big.ws.send("x" * (8 * 1024 + 1))
        big_code = await big.to_end()
        await wait_for(lambda: not srv.server.sessions, timeout=3)   # not parked for 30 s
        return resumed_code, big_code, srv.server.call_connections.parking.parked

    resumed_code, big_code, parked = asyncio.run(go())
    assert resumed_code == 1000 and big_code == 1009 and parked == 0
    srv.wait_idle()


def test_a_reconnect_does_not_restart_the_idle_clock(server):
    """Issue 32's rule, idle means nothing received, holds across connections: a client that drops and resumes a
    call it sends nothing to cannot hold its place beyond serve.idle_timeout_s from its last message."""
    srv, _ = server(resume_grace_s=30, idle_timeout_s=1.5)

    async def go():
        c, token = await realtime_open(srv.ws_url)
        await appends(c, tone(0.24))
        last_sent = time.monotonic()
        await c.take(lambda got: len(audio_frames(got)) == 3)
        c.lose()
        await wait_for(lambda: srv.server.call_connections.parking.parked == 1)
        await asyncio.sleep(max(0.0, last_sent + 1.0 - time.monotonic()))   # 1 s of the 1.5 s gone
        again = await Client.open(f"{srv.ws_url}/v1/realtime?resume={token}&received={len(c.got)}")
        code = await again.to_end()
        return code, time.monotonic() - last_sent, again.got

    code, took, got = asyncio.run(go())
    errors = [e["error"]["code"] for e in got if e["type"] == "error"]
    assert errors == ["idle_timeout"] and code == 1008
    assert 1.4 < took < 2.3   # 1.5 s after the last audio, not 1.5 s after the resume (2.5 s)
    srv.wait_idle()


def test_a_resume_needs_the_servers_api_key_too(server):
    srv, _ = server(resume_grace_s=30, api_keys=["sesame"])
    key = {"Authorization": "Bearer sesame"}

    async def go():
        c, token = await realtime_open(srv.ws_url, headers=key)
        await appends(c, tone(0.24))
        await c.take(lambda got: len(audio_frames(got)) == 3)
        c.lose()
        await wait_for(lambda: srv.server.call_connections.parking.parked == 1)
        url = f"{srv.ws_url}/v1/realtime?resume={token}&received={len(c.got)}"
        with pytest.raises(InvalidStatus) as keyless:
            await connect(url)
        again = await Client.open(url, key)
        await again.ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        code = await again.to_end()
        return refused(keyless.value), code

    (status, body), code = asyncio.run(go())
    assert status == 401 and body["code"] == "unauthorized" and code == 1000
    srv.wait_idle()


def test_resume_off_a_lost_connection_hangs_up_at_once(server):
    srv, _ = server(resume_grace_s=0)

    async def go():
        c, token = await realtime_open(srv.ws_url)
        assert token is None   # nothing to resume with
        await appends(c, tone(0.4))
        await c.take(lambda got: len(audio_frames(got)) >= 1)
        c.lose()
        await wait_for(lambda: not srv.server.sessions, timeout=5)

    asyncio.run(go())
    srv.wait_idle()


def test_shutdown_ends_a_parked_call_at_once_and_refuses_its_resume(server):
    """SIGTERM with a call waiting for its client: nobody may come back to a stopping server, so the call ends
    at once (not after its grace) and the server stops within its shutdown grace."""
    srv, _ = server(resume_grace_s=60, shutdown_grace_s=5)

    async def go():
        c, token = await realtime_open(srv.ws_url)
        await appends(c, tone(0.24))
        await c.take(lambda got: len(audio_frames(got)) == 3)
        c.lose()
        await wait_for(lambda: srv.server.call_connections.parking.parked == 1)
        t0 = time.monotonic()
        srv.uvicorn.should_exit = True
        await wait_for(lambda: not srv.server.sessions, timeout=5)
        took = time.monotonic() - t0
        with pytest.raises((InvalidStatus, OSError)) as late:   # refused, or the port already closed
            await connect(f"{srv.ws_url}/v1/realtime?resume={token}&received={len(c.got)}")
        return took, late

    took, late = asyncio.run(go())
    assert took < 2.0
    if isinstance(late.value, InvalidStatus):
        assert refused(late.value)[0] in (404, 503)
    srv.thread.join(15)
    assert not srv.thread.is_alive()
    assert srv.server.metrics.resumes.labels("expired")._value.get() == 1


# ---- native ------------------------------------------------------------------------------------------------
def native_packets(got) -> list[tuple[int, int]]:
    out = []
    for m in got:
        if isinstance(m, bytes):
            frame, _ = struct.unpack("<If", m[:8])
            pcm = np.frombuffer(m[8:], "<i2")
            assert int(pcm[0]) == frame
            out.append((frame, int(pcm[1])))
    return out


def pcm16(x: np.ndarray) -> bytes:
    return np.clip(np.round(x * 32767), -32768, 32767).astype("<i2").tobytes()


def test_a_native_call_resumes_from_the_message_after_the_last_one_received(server):
    srv, _ = server(resume_grace_s=30)
    first, second = tone(0.8, seed=1), tone(0.4, seed=2)

    async def go():
        c = await Client.open(f"{srv.ws_url}/generate/ws")
        await c.ws.send(json.dumps({"type": "start", "seed": SEED}))
        await c.take(lambda got: len(got) >= 1)
        started = c.got[0]
        assert started["type"] == "started" and started["resume"]["grace_s"] == 30
        await c.ws.send(pcm16(first))
        await c.take(lambda got: len(native_packets(got)) >= 4)
        received = list(c.got)
        c.lose()
        await wait_for(lambda: srv.server.call_connections.parking.parked == 1)
        again = await Client.open(f"{srv.ws_url}/generate/ws?resume={started['resume']['token']}"
                                  f"&received={len(received)}")
        await again.ws.send(pcm16(second))
        await again.ws.send(json.dumps({"type": "end_input"}))
        code = await again.to_end()
        return received + again.got, code

    whole, code = asyncio.run(go())
    frames = (first.size + second.size) // FRAME_IN
    assert code == 1000 and native_packets(whole) == [(k, SEED) for k in range(frames)]
    assert [m for m in whole if isinstance(m, dict) and m["type"] in ("drained", "ended")] == [
        {"type": "drained", "frames": frames}, {"type": "ended", "reason": "completed"}]
    srv.wait_idle()


def test_the_call_script_resumes_a_lost_connection(server, tmp_path):
    """scripts/call.py (native, paced) loses its connection mid-call (the server's side of it is reset): it
    reconnects with the call's token and message count, and writes the whole call: every frame the engine
    stepped exactly once, in order, and the normal end."""
    import subprocess
    import sys

    from tests.server_support import wav_bytes

    srv, _ = server(resume_grace_s=30)
    clip = tmp_path / "in.wav"
    clip.write_bytes(wav_bytes(tone(2.0)))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "scripts/call.py", str(clip), "--url", srv.url, "--seed", str(SEED),
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:   # a few frames into the call, reset its connection
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            live = list(srv.server.call_connections.parking.live.values())
            if live and live[0].sent.sent >= 8:
                break
            time.sleep(0.02)
        srv.reset_connection("/generate/ws")
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-2000:]
    assert "resumed 1x" in stdout, stdout
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert events[-1] == {"type": "ended", "reason": "completed"} and not [e for e in events if e["type"] == "error"]
    (drained,) = [e["frames"] for e in events if e["type"] == "drained"]
    frames = [int(x.split()[0]) for x in (out / "lag.tsv").read_text().splitlines()[1:]]
    assert frames == list(range(drained)) and drained >= 20   # each stepped frame once (a dropout loses input)
    srv.wait_idle()
