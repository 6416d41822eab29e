"""serve.replicas: the server on Ray Serve, two tiny replicas on the CPU behind one endpoint
(server/replicas.py, docs/deploy.md). The deployment tests start the user's command, `scripts/serve.py
serve.replicas=2`, once for the module (a local Ray cluster; about 30 s to ready on two cores); the
middleware and aggregation tests need no Ray. Just past 500 lines: the deployment tests share one Ray start."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from nemo_duplex.server.replicas import (
    ReplicaGone,
    ReplicaRoute,
    deployment_health,
    deployment_metrics,
    label_metrics,
)
from tests.server_support import NATIVE, b64, frames_of, free_port, tone

ROOT = Path(__file__).resolve().parents[1]
FRAME_IN = 1280


# ---- without Ray ------------------------------------------------------------------------------------------
def run_asgi(app, scope_type: str, path: str, client_closes: bool = False):
    """Drive ReplicaGone(app) with one WebSocket or HTTP scope; returns what reached the client."""
    sent = []

    async def go():
        gone = {"type": f"{'websocket' if scope_type == 'websocket' else 'http'}.disconnect", "code": 1000}
        incoming = ([{"type": "websocket.connect"}] if scope_type == "websocket" else []) + \
            ([gone] if client_closes else [])

        async def receive():
            if incoming:
                return incoming.pop(0)
            await asyncio.sleep(3600)

        async def send(message):
            sent.append(message)

        await ReplicaGone(app)({"type": scope_type, "path": path, "headers": []}, receive, send)
    asyncio.run(go())
    return sent


def replying(then: str, scope_type: str = "websocket"):
    """An ASGI app standing for Serve's route to a replica: it starts its reply (accepts the socket, or
    starts the NDJSON stream with one line), then the replica dies (`dies`: the proxy sends nothing more,
    or an error reply of its own that cannot follow a started one), ends normally (`ends`), or sees the
    client leave (`client_left`)."""
    ws = scope_type == "websocket"

    async def app(scope, receive, send):
        if ws:
            await receive()
        await send({"type": "websocket.accept"} if ws else {"type": "http.response.start", "status": 200, "headers": []})
        if not ws:
            await send({"type": "http.response.body", "body": b'{"type": "frame"}\n', "more_body": True})
        if then == "dies":
            await send({"type": "http.response.start", "status": 500, "headers": []})
            await send({"type": "http.response.body", "body": b"Internal Server Error"})
        elif then == "ends":
            await send({"type": "websocket.close", "code": 1000} if ws else {"type": "http.response.body", "body": b""})
        else:
            assert (await receive())["type"].endswith("disconnect")
    return app


@pytest.mark.parametrize("path", ["/v1/realtime", "/generate/ws"])
def test_a_call_whose_replica_dies_gets_replica_failed_and_1011(path):
    sent = run_asgi(replying("dies"), "websocket", path)
    assert [m["type"] for m in sent] == ["websocket.accept", "websocket.send", "websocket.close"]
    body = json.loads(sent[1]["text"])
    code = body["error"]["code"] if path == "/v1/realtime" else body["code"]
    assert code == "replica_failed" and sent[2]["code"] == 1011
    if path == "/v1/realtime":
        assert body["error"]["type"] == "server_error"


def test_an_upload_whose_replica_dies_ends_its_stream_with_replica_failed():
    sent = run_asgi(replying("dies", "http"), "http", "/generate")
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert sent[0]["status"] == 200 and sent[1]["more_body"] and not sent[2]["more_body"]
    assert json.loads(sent[2]["body"])["code"] == "replica_failed"


@pytest.mark.parametrize("scope_type, path", [("websocket", "/v1/realtime"), ("http", "/generate")])
@pytest.mark.parametrize("then, client_closes", [("ends", False), ("client_left", True)])
def test_a_call_that_ends_normally_gets_nothing_more(scope_type, path, then, client_closes):
    sent = run_asgi(replying(then, scope_type), scope_type, path, client_closes)
    ws = scope_type == "websocket"
    expected = ["websocket.accept"] if ws else ["http.response.start", "http.response.body"]
    if then == "ends":
        expected.append("websocket.close" if ws else "http.response.body")
    assert [m["type"] for m in sent] == expected


def test_metrics_of_every_replica_are_labelled_and_described_once():
    text = ("# HELP duplex_active_calls calls\n# TYPE duplex_active_calls gauge\nduplex_active_calls 3.0\n"
            '# HELP duplex_refusals refused\n# TYPE duplex_refusals counter\nduplex_refusals_total{reason="busy"} 2.0\n')
    snap = {"expected": 2, "replicas": {
        "a": {"fresh": True, "ready": True, "metrics": text, "active_calls": 3, "sessions": 3, "max_calls": 4, "pid": 1},
        "b": {"fresh": True, "ready": False, "metrics": text, "active_calls": 0, "sessions": 0, "max_calls": 4, "pid": 2},
        "c": {"fresh": False, "ready": True, "metrics": text, "active_calls": 9, "sessions": 9, "max_calls": 4, "pid": 3}}}
    out = deployment_metrics(snap).splitlines()
    assert 'duplex_active_calls{replica="a"} 3.0' in out and 'duplex_active_calls{replica="b"} 3.0' in out
    assert 'duplex_refusals_total{replica="b",reason="busy"} 2.0' in out
    assert not any('replica="c"' in line for line in out)           # not heard from lately: left out
    assert out.count("# TYPE duplex_active_calls gauge") == 1
    assert "duplex_replicas_ready 1" in out and "duplex_replicas_expected 2" in out
    body, status = deployment_health(snap)
    assert status == 503 and body["replicas_ready"] == 1 and body["active_calls"] == 3
    snap["replicas"]["b"]["ready"] = True
    assert deployment_health(snap)[1] == 200
    assert label_metrics("duplex_x 1", "r", set()) == ['duplex_x{replica="r"} 1']


def routed_scope(scope: dict) -> dict:
    """The scope the proxy's app sees behind ReplicaRoute."""
    seen = {}

    async def app(scope_in, receive, send):
        seen["scope"] = scope_in
    asyncio.run(ReplicaRoute(app)(scope, None, None))
    return seen["scope"]


def test_a_resume_is_routed_by_its_token_and_a_client_cannot_pick_a_replica():
    """ReplicaRoute: `?resume=<replica>.<random>` on a call route gives Serve that replica as the session id
    (server/routing.py follows it); a session id header from the client is dropped on every request, whatever
    its spelling; a token without a route adds none."""
    def headers(path, query, extra=(), kind="websocket"):
        scope = {"type": kind, "path": path, "query_string": query.encode(),
                 "headers": [(b"origin", b"x"), *extra]}
        return routed_scope(scope)["headers"]

    assert headers("/v1/realtime", "resume=r1abc.Zx-_9&received=3") == [(b"origin", b"x"), (b"x-session-id", b"r1abc")]
    assert headers("/generate/ws", "received=3&resume=r2.q") == [(b"origin", b"x"), (b"x-session-id", b"r2")]
    picked = [(b"X-Session-Id", b"r1abc"), (b"x_session_id", b"r1abc")]
    assert headers("/v1/realtime", "", picked) == [(b"origin", b"x")]
    assert headers("/v1/realtime", "resume=nodot&received=0", picked) == [(b"origin", b"x")]
    assert headers("/v1/realtime", "resume=.q&received=0") == [(b"origin", b"x")]
    assert headers("/generate", "resume=r1.q", picked, kind="http") == [(b"origin", b"x")]
    assert headers("/health", "resume=r1.q", kind="websocket") == [(b"origin", b"x")]
    # a Realtime call opened with a client secret goes to the replica that minted it (Bearer or subprotocol)
    secret = [(b"authorization", b"Bearer ek_r3.Zq")]
    assert headers("/v1/realtime", "", secret) == [(b"origin", b"x"), *secret, (b"x-session-id", b"r3")]
    offered = [(b"sec-websocket-protocol", b"realtime, openai-insecure-api-key.ek_r4.Zq")]
    assert headers("/v1/realtime", "", offered) == [(b"origin", b"x"), *offered, (b"x-session-id", b"r4")]
    key = [(b"authorization", b"Bearer sk-r5.x")]
    assert headers("/v1/realtime", "", key) == [(b"origin", b"x"), *key]         # a real key: any replica
    assert headers("/generate/ws", "", secret) == [(b"origin", b"x"), *secret]   # (refused there anyway)


@pytest.mark.parametrize("lost", [True, False])
def test_a_lost_transport_reaches_the_replica_as_1006(lost):
    """ReplicaRoute: a disconnect whose transport the proxy's protocol marked lost (server/transport.py) goes on
    with 1006, which the replica's Socket reads as lost (its call waits to be resumed); a close frame's code,
    1005 included, goes on as it is (a hang-up)."""
    from nemo_duplex.server.ws import TRANSPORT_LOST

    scope = {"type": "websocket", "path": "/v1/realtime", "query_string": b"", "headers": []}
    gone = {"type": "websocket.disconnect", "code": 1005}

    async def app(scope_in, receive, send):
        assert (await receive())["type"] == "websocket.connect"
        if lost:
            scope[TRANSPORT_LOST] = True   # as the protocol marks it, in its own scope, before the disconnect
        app.got = await receive()

    incoming = [{"type": "websocket.connect"}, gone]

    async def receive():
        return incoming.pop(0)
    asyncio.run(ReplicaRoute(app)(scope, receive, None))
    assert app.got == {"type": "websocket.disconnect", "code": 1006 if lost else 1005}


def test_the_router_sends_a_resume_to_the_replica_that_holds_its_call():
    """routing.ranks: every candidate in one rank (the most free places wins), or the holder alone."""
    pytest.importorskip("ray")
    from types import SimpleNamespace

    from nemo_duplex.server.routing import ranks

    a, b = (SimpleNamespace(replica_id=SimpleNamespace(unique_id=u)) for u in ("ra", "rb"))
    assert ranks([a, b], "") == [[a, b]]
    assert ranks([a, b], "rb") == [[b]]
    assert ranks([a, b], "gone") == [[a, b]]   # the holder died: anyone (it answers unknown_resume_token)
    assert ranks([], "ra") == []


@pytest.mark.parametrize("message", ["a" * 4096, "é" * 2048, b"\0" * 4096, "é" * 2049, "a" * 4097, b"\0" * 4097])
def test_serve_max_message_kb_holds_behind_a_proxy_that_does_not_enforce_it(message):
    """Serve's proxy takes WebSocket messages up to its own limit; the server's Socket enforces
    serve.max_message_kb itself (here 4 KiB): exactly the limit in UTF-8 bytes is taken, one byte more
    closes with 1009 naming the setting."""
    from nemo_duplex.server.ws import Socket

    class FakeWebSocket:
        closed_with = None

        async def receive(self):
            return {"type": "websocket.receive", **({"text": message} if isinstance(message, str) else {"bytes": message})}

        async def close(self, code, reason):
            self.closed_with = (code, reason)

    ws = FakeWebSocket()
    got = asyncio.run(Socket(ws, 4096).receive())
    size = len(message.encode() if isinstance(message, str) else message)
    if size <= 4096:
        assert got.data == message and ws.closed_with is None
    else:
        assert got.kind == "closed" and ws.closed_with[0] == 1009 and "serve.max_message_kb = 4" in ws.closed_with[1]


@pytest.mark.parametrize("args, says", [
    (["serve.replicas=0"], "serve.replicas=0: at least 1"),
    (["serve.ray_address=local", "device=cuda:0"], "device=cuda:0 with serve.replicas=1"),
    (["serve.replicas=2", "device=cuda:1"], "device=cuda:1 with serve.replicas=2"),
])
def test_replica_settings_that_cannot_be_honoured_are_refused(args, says):
    r = subprocess.run([sys.executable, "scripts/serve.py", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


# ---- two replicas on Ray Serve ----------------------------------------------------------------------------
def get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return None, b""


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("replicas") / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "scripts/serve.py", "serve.replicas=2", f"serve.port={port}", "engine.max_calls=3",
         "serve.warmup_frames=1", f"hydra.run.dir={log.parent}"],
        cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while get(f"{url}/health")[0] != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"serve.replicas=2 did not get ready (exit {proc.poll()}):\n{log.read_text()[-4000:]}")
        time.sleep(1)
    yield url, proc, log
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def health(url: str) -> dict:
    return json.loads(get(f"{url}/health")[1])


class Caller:
    """One Realtime call through the deployment's endpoint, audio sent by the test, events read by a task."""

    def __init__(self, ws):
        self.ws, self.events, self.replica = ws, [], ws.response.headers.get("x-replica")
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, url: str):
        import websockets

        ws = await websockets.connect(url.replace("http", "ws") + "/v1/realtime", max_size=None)
        try:
            await ws.send(json.dumps({"type": "session.update", "session": NATIVE}))
        except websockets.ConnectionClosedError:   # refused (busy) before it was read
            pass
        return cls(ws)

    async def _read(self):
        import websockets

        try:
            async for m in self.ws:
                if isinstance(m, str):
                    self.events.append(json.loads(m))
        except websockets.ConnectionClosedError:   # a close other than 1000/1001: close_code says which
            pass

    async def say(self, audio: np.ndarray):
        for i in range(0, audio.size, FRAME_IN):
            await self.ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(audio[i:i + FRAME_IN])}))

    async def finish(self, timeout: float = 60):
        await self.ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        await asyncio.wait_for(self.reader, timeout)
        return self.ws.close_code

    def codes(self):
        return [e["error"]["code"] for e in self.events if e["type"] == "error"]

    def frames(self) -> int:
        return len(frames_of(self.events))


def test_health_and_metrics_speak_for_both_replicas(deployment):
    url, _, _ = deployment
    body = health(url)
    assert body["status"] == "ready" and body["replicas_ready"] == 2 and body["max_calls"] == 6
    metrics = get(f"{url}/metrics")[1].decode()
    assert "duplex_replicas_ready 2" in metrics
    for replica in body["replicas"]:
        assert f'duplex_ready{{replica="{replica}"}} 1.0' in metrics


def test_the_page_an_upload_and_a_native_call_through_the_endpoint(deployment):
    """Every route of the one-process server answers through Serve's proxy, each reply naming its replica."""
    import aiohttp

    from tests.server_support import wav_bytes

    url, _, _ = deployment

    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/") as r:
                page = r.status, await r.text(), r.headers.get("x-replica")
            async with http.post(f"{url}/generate?seed=0", data=wav_bytes(tone(0.4))) as r:
                upload = r.status, [json.loads(line) async for line in r.content if line.strip()], r.headers.get("x-replica")
            async with http.ws_connect(f"{url.replace('http', 'ws')}/generate/ws") as ws:
                await ws.send_json({"type": "start"})
                await ws.send_bytes((tone(0.24) * 32767).astype("<i2").tobytes())
                await ws.send_json({"type": "end_input"})
                native = [m async for m in ws]
        return page, upload, native

    page, upload, native = asyncio.run(go())
    assert page[0] == 200 and "<html" in page[1].lower() and page[2]
    assert upload[0] == 200 and upload[2] and upload[1][0]["type"] == "started"
    assert upload[1][-1] == {"type": "ended", "reason": "completed"}
    audio = [m for m in native if m.type == aiohttp.WSMsgType.BINARY]
    events = [json.loads(m.data) for m in native if m.type == aiohttp.WSMsgType.TEXT]
    assert len(audio) == 3 and events[-1] == {"type": "ended", "reason": "completed"}


def test_a_lost_connection_resumes_on_the_replica_that_holds_its_call(deployment):
    """serve.resume_grace_s behind Serve's proxy: four calls, two a replica. The connection of one of replica X's
    calls is lost (the client's transport aborted, no close frame); Y's two calls then hang up, so that Y has the
    most free places and a resume routed as a new call would go there. The resume goes to X (its token names
    it), and the call goes on: its frames before and after add up, with no error. A new call that names X in
    Serve's session header itself still goes where places are free (Y)."""
    import websockets

    url, _, _ = deployment
    ws_url = url.replace("http", "ws") + "/v1/realtime"

    async def go():
        callers = []
        for _ in range(4):
            callers.append(await Caller.open(url))
            await callers[-1].say(tone(0.16))
        x, y = sorted({c.replica for c in callers})
        for c in callers:
            for _ in range(200):
                if c.frames() >= 2:
                    break
                await asyncio.sleep(0.05)
            assert c.frames() >= 2, c.events
        lost = next(c for c in callers if c.replica == x)
        token = lost.events[0]["session"]["resume"]["token"]
        assert token.startswith(x + "."), token
        lost.ws.transport.abort()   # the network drops: no close frame
        await asyncio.wait_for(lost.reader, 10)
        for c in callers:
            if c.replica == y:
                assert await c.finish() == 1000 and c.codes() == []
        for _ in range(100):
            if health(url)["replicas"][y]["sessions"] == 0:
                break
            await asyncio.sleep(0.05)
        assert health(url)["replicas"][y]["sessions"] == 0

        ws = await websockets.connect(f"{ws_url}?resume={token}&received={len(lost.events)}", max_size=None)
        back = Caller(ws)
        assert back.replica == x
        await back.say(tone(0.4, seed=1))
        assert await back.finish() == 1000 and back.codes() == [], back.events[-3:]
        assert lost.frames() + back.frames() == 7   # 0.16 s + 0.4 s: every frame once, across both connections
        assert [e for e in back.events if e["type"] == "response.done"]

        pinned = await websockets.connect(ws_url, max_size=None, additional_headers={"x-session-id": x})
        assert pinned.response.headers.get("x-replica") == y
        await pinned.close()
        for c in callers:
            if c.replica == x and c is not lost:
                assert await c.finish() == 1000

    asyncio.run(go())


def test_a_client_secret_opens_its_calls_on_the_replica_that_minted_it(deployment):
    """POST /v1/realtime/client_secrets through the proxy: the secret names the replica that minted it (M), and a
    call opened with it goes there even when the other replica has the most free places (a plain call to M, then
    the other's one hung up)."""
    import aiohttp
    import websockets

    url, _, _ = deployment
    ws_url = url.replace("http", "ws") + "/v1/realtime"

    async def go():
        first, second = await Caller.open(url), await Caller.open(url)
        assert {first.replica, second.replica} == set(health(url)["replicas"])
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/realtime/client_secrets", json={"session": {"instructions": "Hi."}}) as r:
                value, minted_by = (await r.json())["value"], r.headers.get("x-replica")
        assert value.startswith(f"ek_{minted_by}.")
        other = first if first.replica != minted_by else second
        assert await other.finish() == 1000
        for _ in range(100):
            if health(url)["replicas"][other.replica]["sessions"] == 0:
                break
            await asyncio.sleep(0.05)
        ws = await websockets.connect(ws_url, max_size=None, additional_headers={"Authorization": f"Bearer {value}"})
        opened = Caller(ws)
        assert opened.replica == minted_by
        await opened.say(tone(0.16))
        assert await opened.finish() == 1000 and opened.codes() == []
        assert opened.events[0]["session"]["instructions"] == "Hi."
        for c in (first, second):
            if c is not other:
                assert await c.finish() == 1000

    asyncio.run(go())


def test_calls_go_where_places_are_free_and_a_dead_replica_takes_only_its_calls(deployment):
    url, _, log = deployment

    async def go():
        callers = []
        for _ in range(6):   # one at a time: each to the replica with the most free places -> 3 + 3
            callers.append(await Caller.open(url))
            await callers[-1].say(tone(0.16))
        replicas = sorted({c.replica for c in callers})
        assert len(replicas) == 2 and all(sum(c.replica == r for c in callers) == 3 for r in replicas)

        extra = await Caller.open(url)   # every place taken: refused at once, not queued
        await asyncio.wait_for(extra.reader, 10)
        assert extra.codes() == ["busy"] and extra.ws.close_code == 1013

        victim, survivor = replicas
        pid = health(url)["replicas"][victim]["pid"]
        for c in callers:   # every call live and heard
            for _ in range(200):
                if c.frames() >= 2:
                    break
                await asyncio.sleep(0.05)
            assert c.frames() >= 2, c.events
        os.kill(pid, signal.SIGKILL)

        lost = [c for c in callers if c.replica == victim]
        kept = [c for c in callers if c.replica == survivor]
        await asyncio.wait_for(asyncio.gather(*(c.reader for c in lost)), 30)
        for c in lost:
            assert c.codes() == ["replica_failed"] and c.ws.close_code == 1011, (c.codes(), c.ws.close_code,
                                                                                 c.events[-3:])
        for c in kept:   # untouched: more audio, then a normal end with every frame
            await c.say(tone(0.4, seed=1))
            assert await c.finish() == 1000
            assert c.codes() == [] and c.frames() == 7
            assert [e for e in c.events if e["type"] == "response.done"]

        for _ in range(100):   # a place comes back once the engine has ended its call, a moment after the close
            if health(url)["replicas"][survivor]["sessions"] == 0:
                break
            await asyncio.sleep(0.05)
        after = await Caller.open(url)   # a living replica takes it (the survivor, or the victim's replacement)
        await after.say(tone(0.16))
        assert await after.finish() == 1000 and after.codes() == [] and after.replica != victim
        return victim

    victim = asyncio.run(go())
    # Serve replaces the replica (a new replica id); the deployment is whole again. The dead one counted as
    # ready until its last report was 3 s old (replicas.STALE_AFTER_S)
    deadline = time.monotonic() + 180
    while (body := health(url))["status"] != "ready" or body["replicas"].get(victim, {}).get("fresh"):
        assert time.monotonic() < deadline, (body, log.read_text()[-3000:])
        time.sleep(1)
