"""Hostile and edge input at the server's edge (scripted frame step, tests/server_support.py): every field
is checked for its type and range where it enters, with an error naming the field and its limit, and the
call (or the next one) goes on; ids are validated; limits hold at exactly their value. Just past 500 lines:
one check per field of both protocols."""
from __future__ import annotations

import asyncio
import base64
import json
import time

import aiohttp
import pytest

from tests.server_support import tone, wav_bytes
from tests.test_server import FRAME_IN, errors, frames_of, realtime


def refusal(events) -> dict:
    return next(e for e in events if e["type"] == "error")["error"]


@pytest.mark.parametrize("session,code,param", [
    ({"seed": 2 ** 63}, "invalid_event", "session.seed"),
    ({"seed": -1}, "invalid_event", "session.seed"),
    ({"temperature": 1e308}, "invalid_sampling", "session.temperature"),
    ({"repetition_penalty": 1e6}, "invalid_sampling", "session.repetition_penalty"),
    ({"voice": ["Aria"]}, "invalid_event", "session.voice"),
    ({"voice": 3}, "invalid_event", "session.voice"),
    ({"audio": {"output": {"voice": True}}}, "invalid_event", "session.audio.output.voice"),
    ({"audio": {"output": {"voice": [1]}}}, "invalid_event", "session.audio.output.voice"),
])
def test_session_fields_out_of_type_or_range_are_refused_and_the_call_goes_on(server, session, code, param):
    """Before, seed 2^63 and temperature 1e308 were accepted and failed in the engine (engine_error), and a
    voice of the wrong type raised a traceback and dropped the socket. Now: the error names the field; the
    session keeps its settings; the call then runs and completes."""
    srv, _ = server()
    events, close = asyncio.run(realtime(srv.ws_url, tone(0.24), chunk=FRAME_IN, session=session))
    err = refusal(events)
    assert (err["code"], err["param"]) == (code, param), err
    assert errors(events) == [code] and close == 1000 and events[-1]["type"] == "session.closed"
    assert len(frames_of(events)) == 3
    srv.wait_idle()


@pytest.mark.parametrize("raw", [
    '{"type": "session.update", "session": {"temperature": Infinity}}',
    '{"type": "session.update", "session": {"top_p": NaN}}',
])
def test_infinity_and_nan_are_not_numbers_here(server, raw):
    srv, _ = server()
    events, close = asyncio.run(realtime(srv.ws_url, tone(0.16), chunk=FRAME_IN, extra=[raw]))
    err = refusal(events)
    assert err["code"] == "invalid_event" and "finite" in err["message"] and close == 1000
    srv.wait_idle()


@pytest.mark.parametrize("raw,param", [
    ('{"type": "session.update", "session": {"instructions": "hi \\ud800 there"}}', "session.instructions"),
    ('{"type": "session.update", "session": {"tools": [{"type": "function", "name": "a\\udfff"}]}}',
     "session.tools[0].name"),
])
def test_lone_surrogates_are_refused_naming_the_field(server, raw, param):
    """A lone UTF-16 surrogate (valid JSON, not text) in the instructions or a tool name raised a traceback in
    the tokenizer and dropped the socket; now an error names where it is. A surrogate pair is text."""
    srv, model = server()
    pair = '{"type": "session.update", "session": {"instructions": "ok \\ud83d\\ude00"}}'
    events, close = asyncio.run(realtime(srv.ws_url, tone(0.16), chunk=FRAME_IN, extra=[raw, pair]))
    err = refusal(events)
    assert (err["code"], err["param"]) == ("invalid_event", param) and close == 1000
    assert errors(events) == ["invalid_event"]
    assert model.prompts[-1] is not None   # the pair's instructions became the prompt
    srv.wait_idle()


def test_native_opening_with_a_lone_surrogate_is_refused(server):
    srv, _ = server()

    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(f"{srv.ws_url}/generate/ws") as ws:
                await ws.send_str('{"type": "start", "prompt": "x\\udc00"}')
                msgs = [json.loads(m.data) async for m in ws if m.type == aiohttp.WSMsgType.TEXT]
                return msgs, ws.close_code

    msgs, close = asyncio.run(go())
    assert msgs[-1]["code"] == "invalid_event" and "prompt" in msgs[-1]["message"] and close == 1008
    srv.wait_idle()


@pytest.mark.parametrize("call_id", ["a\r\nSet-Cookie: x=1", "x" * 7900, "", "spaces are not ids"])
def test_call_ids_are_validated(server, call_id):
    """A call_id with CR/LF gave a 500 (it goes into the X-Call-Id header) and a 7.9 KB one was repeated in
    every event: 1 to 64 of A-Z a-z 0-9 . _ : - now, else 400 invalid_call_id, on every route."""
    srv, _ = server()
    body = wav_bytes(tone(0.2))

    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{srv.url}/generate", params={"call_id": call_id}, data=body) as r:
                upload = r.status, (await r.json() if r.status != 200 else await r.read())
            async with http.ws_connect(f"{srv.ws_url}/generate/ws") as ws:
                await ws.send_json({"type": "start", "call_id": call_id})
                if call_id == "":   # the call starts: end it rather than wait for its idle timeout
                    await ws.send_json({"type": "end_input"})
                native = [json.loads(m.data) async for m in ws if m.type == aiohttp.WSMsgType.TEXT]
            return upload, native

    (status, body_json), native = asyncio.run(go())
    if call_id == "":   # an empty id is no id: the server makes one
        assert status == 200 and not [m for m in native if m.get("type") == "error"], native
        srv.wait_idle()
        return
    assert status == 400 and body_json["code"] == "invalid_call_id" and "1 to 64" in body_json["message"]
    assert native[-1]["code"] == "invalid_call_id"
    srv.wait_idle()


def test_input_of_exactly_max_call_s_completes(server):
    """Before, input of exactly engine.max_call_s ended with call_too_long instead of completing."""
    srv, _ = server(max_call_s=0.4)
    events, close = asyncio.run(realtime(srv.ws_url, tone(0.4), chunk=FRAME_IN))
    assert errors(events) == [] and close == 1000 and events[-1] == {**events[-1], "reason": "completed"}
    assert len(frames_of(events)) == 5
    srv.wait_idle()


def test_a_message_of_exactly_max_message_kb_is_taken(server):
    """serve.max_message_kb is the largest message taken: exactly that many bytes is heard, one more closes
    the socket with 1009 (message too big)."""
    srv, model = server(max_message_kb=4)

    async def go(n_bytes):
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(f"{srv.ws_url}/generate/ws") as ws:
                await ws.send_json({"type": "start", "seed": n_bytes})
                await ws.send_bytes(b"\x00\x01" * (n_bytes // 2))
                await ws.send_json({"type": "end_input"})
                msgs = [m async for m in ws]
                return [json.loads(m.data) for m in msgs if m.type == aiohttp.WSMsgType.TEXT], ws.close_code

    msgs, close = asyncio.run(go(4096))
    assert close == 1000 and msgs[-1] == {"type": "ended", "reason": "completed"}
    assert len(model.heard[4096]) == 2           # 2048 samples: one whole frame and a padded one
    msgs, close = asyncio.run(go(4098))
    assert close == 1009
    srv.wait_idle()


def test_a_realtime_append_at_the_message_limit(server):
    """The same limit for a Realtime append: the JSON text frame's size counts."""
    srv, model = server(max_message_kb=8)
    pcm = b"\x00\x00" * 2900
    msg = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
    assert len(msg) < 8192
    events, close = asyncio.run(realtime(srv.ws_url, None, extra=[msg], session={"seed": 12}))
    assert errors(events) == [] and close == 1000 and len(model.heard[12]) == 3
    srv.wait_idle()


def test_shutdown_drains_then_cuts_with_server_shutdown(server):
    """SIGTERM (uvicorn's should_exit, what its signal handler sets) mid-call: the live call froze until its
    idle timeout before. Now new calls are refused with server_shutdown, the live call gets
    serve.shutdown_grace_s to end, then an error `server_shutdown` naming the setting and a close; the
    server stops."""
    srv, _ = server(shutdown_grace_s=1.0)

    async def go():
        live = asyncio.create_task(realtime(srv.ws_url, tone(6.0), chunk=FRAME_IN, pace=0.08))
        await asyncio.sleep(0.8)
        t0 = time.monotonic()
        srv.uvicorn.should_exit = True
        await asyncio.sleep(0.3)
        late = await realtime(srv.ws_url, tone(0.2), chunk=FRAME_IN)
        events, close = await live
        return events, close, time.monotonic() - t0, late

    events, close, took, (late_events, _) = asyncio.run(go())
    assert errors(late_events) == ["server_shutdown"]
    err = refusal(events)
    assert err["code"] == "server_shutdown" and "serve.shutdown_grace_s = 1 s" in err["message"]
    assert close == 1008 and 1.0 <= took < 3.0
    assert 5 <= len(frames_of(events)) < 75        # it ran until the cut, not to its end
    srv.thread.join(15)
    assert not srv.thread.is_alive()


def test_shutdown_lets_a_call_that_ends_within_the_grace_finish(server):
    srv, _ = server(shutdown_grace_s=5.0)

    async def go():
        live = asyncio.create_task(realtime(srv.ws_url, tone(1.6), chunk=FRAME_IN, pace=0.08))
        await asyncio.sleep(0.5)
        srv.uvicorn.should_exit = True
        return await live

    events, close = asyncio.run(go())
    assert errors(events) == [] and close == 1000 and len(frames_of(events)) == 20
    srv.thread.join(15)
    assert not srv.thread.is_alive()


def test_every_open_connection_counts_against_the_connection_limit(server):
    """Native sockets that never send their opening message held no place and were not counted: enough of
    them would exhaust the server's descriptors. Now each open call connection counts; one more than
    serve.max_connections is refused with 503 too_many_connections, and closing one frees its count."""
    srv, _ = server(max_connections=2, idle_timeout_s=30)

    async def go():
        async with aiohttp.ClientSession() as http:
            a = await http.ws_connect(f"{srv.ws_url}/generate/ws")
            b = await http.ws_connect(f"{srv.ws_url}/v1/realtime")
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(f"{srv.ws_url}/generate/ws")
            async with http.post(f"{srv.url}/generate", data=wav_bytes(tone(0.2))) as r:
                upload = r.status, (await r.json())["code"]
            async with http.get(f"{srv.url}/metrics") as r:
                metrics = await r.text()
            await a.close()
            await asyncio.sleep(0.2)
            c = await http.ws_connect(f"{srv.ws_url}/generate/ws")   # a's count is back
            await c.close()
            await b.close()
            return refused.value.status, upload, metrics

    status, upload, metrics = asyncio.run(go())
    assert status == 503 and upload == (503, "too_many_connections")
    assert "duplex_connections 2.0" in metrics and 'duplex_refusals_total{reason="too_many_connections"} 2.0' in metrics
    srv.wait_idle()


def test_websocket_pings_do_not_keep_an_idle_call(server):
    """A client that only sends WebSocket pings (control frames, answered by the protocol layer) sends no audio
    and no event: it is idle, and its call ends at serve.idle_timeout_s."""
    srv, _ = server(idle_timeout_s=0.6)

    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(f"{srv.ws_url}/v1/realtime", autoping=False) as ws:
                async def ping():
                    while not ws.closed:
                        await ws.ping()
                        await asyncio.sleep(0.1)
                pinger = asyncio.create_task(ping())
                t0 = time.monotonic()
                msgs = [json.loads(m.data) async for m in ws if m.type == aiohttp.WSMsgType.TEXT]
                pinger.cancel()
                return msgs, time.monotonic() - t0

    msgs, took = asyncio.run(go())
    assert msgs[-1]["type"] == "error" and msgs[-1]["error"]["code"] == "idle_timeout" and took < 3.0
    srv.wait_idle()


def test_resets_during_the_upgrade_write_no_tracebacks(server, capfd, caplog):
    """Connections reset in the middle of the upgrade request, right after it, and just after the server
    accepted it: the old server wrote a 1.6 KB traceback for each (a log flood). Now each reset the server
    sees before the connection is accepted is one line in the log and counted in /metrics, no place is held
    and the server goes on serving: the two inside the request exactly (stage "request"); one right after it
    is counted at the upgrade when the reset arrives before the server accepted, else the call sees the
    client gone."""
    import base64 as b64mod
    import os
    import socket
    import struct

    import logging

    srv, _ = server()
    capfd.readouterr()
    caplog.set_level(logging.INFO, logger="nemo_duplex.server")
    for path in ("/v1/realtime", "/generate/ws"):
        for cut in ("inside", "after", "accepted"):
            s = socket.create_connection(("127.0.0.1", srv.port))
            key = b64mod.b64encode(os.urandom(16)).decode()
            req = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()
            s.sendall(req[: len(req) // 2] if cut == "inside" else req)
            if cut == "accepted":
                s.recv(1024)   # the 101
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # RST on close
            s.close()
    time.sleep(0.5)
    events, close = asyncio.run(realtime(srv.ws_url, tone(0.16), chunk=FRAME_IN))
    assert close == 1000 and len(frames_of(events)) == 2
    out, err = capfd.readouterr()
    resets = srv.server.metrics.connection_resets
    counted = resets.labels("request")._value.get() + resets.labels("upgrade")._value.get()
    assert resets.labels("request")._value.get() == 2 and resets.labels("upgrade")._value.get() <= 2
    lines = (out + err).strip().splitlines()
    assert "Traceback" not in out + err and len(lines) <= 6, (out + err)[-2000:]
    said = [r.getMessage() for r in caplog.records if "reset before its" in r.getMessage()]
    assert len(said) == counted and all(len(line) < 200 and "\n" not in line for line in said), said
    srv.wait_idle()


def test_the_same_session_again_after_audio_is_acknowledged(server):
    """Clients such as the Agents SDK send their session configuration again once the call runs: the same
    settings are answered with session.updated; a changed one is session_locked naming it."""
    srv, _ = server()
    first = {"instructions": "Be brief.", "seed": 4, "voice": "alloy"}
    sent = []

    async def on_event(ev, ws):
        if ev["type"] == "response.output_audio.delta" and not sent:
            sent.append(1)
            await ws.send_json({"type": "session.update", "session": first})
            await ws.send_json({"type": "session.update", "session": {**first, "instructions": "Be long."}})
            await ws.send_json({"type": "input_audio_buffer.commit", "final": True})

    events, close = asyncio.run(realtime(srv.ws_url, tone(0.4), chunk=FRAME_IN, session=first, final=False,
                                         on_event=on_event))
    assert [e["type"] for e in events].count("session.updated") == 3      # NATIVE formats, first, first again
    err = refusal(events)
    assert err["code"] == "session_locked" and err["param"] == "session.instructions" and close == 1000
    srv.wait_idle()


@pytest.mark.parametrize("hang_up", [False, True])
def test_an_upload_whose_client_half_closes_still_gets_its_reply(server, hang_up):
    """Before, a client that shut its sending side after the upload (a TCP half-close, as `curl -T` and
    proxies do) got 0 bytes back: uvicorn closed on the EOF and the call was cut. Now the whole NDJSON reply
    comes back. A client that closes entirely still frees its place (the next write finds it gone)."""
    import socket

    srv, _ = server()
    body = wav_bytes(tone(0.8))
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: audio/wav\r\nContent-Length: %d\r\n\r\n"
                 % len(body) + body)
    if hang_up:
        sock.close()
        srv.wait_idle()
        return
    sock.shutdown(socket.SHUT_WR)
    sock.settimeout(30)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, stream = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    lines = [json.loads(line) for line in dechunk(stream).splitlines() if line.strip()]
    assert lines[0]["type"] == "started" and lines[-1] == {"type": "ended", "reason": "completed"}
    assert sum(1 for line in lines if line["type"] == "audio") == 10
    srv.wait_idle()


def dechunk(stream: bytes) -> bytes:
    """An HTTP/1.1 chunked body's data."""
    out = b""
    while stream:
        size, _, rest = stream.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, stream = out + rest[:n], rest[n + 2:]
    return out


# ---- a call's own limit: max_call_s (an extension of both protocols) ------------------------------------
# each as JSON text, on a server whose engine.max_call_s is 2 s: a string, a bool, out of range, above the
# server's limit, not finite (Python's JSON reads NaN and Infinity), not a number
BAD_LIMITS = ['"1"', "true", "-1", "0", "2.5", "NaN", "Infinity", "[1]"]


def spy_open_call(monkeypatch, srv) -> list:
    """The CallOptions of every call the server opens on its engine, in order."""
    engine = srv.server.engine
    opened, real = [], engine.open_call

    def open_call(options=None, *args, **kwargs):
        opened.append(options)
        return real(options, *args, **kwargs)

    monkeypatch.setattr(engine, "open_call", open_call)
    return opened


async def native_call(url: str, opening: str, pcm: bytes | None) -> tuple[list, int, int]:
    """A /generate/ws call: the opening (JSON text), the audio, end_input -> (JSON messages, packets, close)."""
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{url}/generate/ws") as ws:
        await ws.send_str(opening)
        if pcm is not None:
            try:
                for i in range(0, len(pcm), 2 * FRAME_IN):
                    await ws.send_bytes(pcm[i:i + 2 * FRAME_IN])
                    await asyncio.sleep(0.005)
                await ws.send_json({"type": "end_input"})
            except ConnectionError:   # the server ended the call (a limit)
                pass
        msgs, packets = [], 0
        async for m in ws:
            if m.type == aiohttp.WSMsgType.TEXT:
                msgs.append(json.loads(m.data))
            elif m.type == aiohttp.WSMsgType.BINARY:
                packets += 1
        return msgs, packets, ws.close_code


def pcm16(x) -> bytes:
    return (x * 32767).astype("<i2").tobytes()


def test_a_realtime_max_call_s_out_of_type_or_range_is_refused_naming_it(server, monkeypatch):
    """Each bad value gets invalid_event with param session.max_call_s (the range error names the server's
    limit); the session keeps its settings and the call then runs on the server's limit."""
    srv, _ = server(max_call_s=2.0)
    opened = spy_open_call(monkeypatch, srv)
    extra = ['{"type": "session.update", "session": {"max_call_s": ' + value + "}}" for value in BAD_LIMITS]
    events, close = asyncio.run(realtime(srv.ws_url, tone(0.24), chunk=FRAME_IN, extra=extra))
    errs = [e["error"] for e in events if e["type"] == "error"]
    assert [(e["code"], e["param"]) for e in errs] == [("invalid_event", "session.max_call_s")] * len(BAD_LIMITS)
    for value in ("-1", "0", "2.5"):
        assert "0 < max_call_s <= engine.max_call_s = 2 s" in errs[BAD_LIMITS.index(value)]["message"]
    assert "finite" in errs[BAD_LIMITS.index("NaN")]["message"]
    assert close == 1000 and len(frames_of(events)) == 3
    assert opened[0].max_call_s is None
    srv.wait_idle()


def test_a_native_max_call_s_out_of_type_or_range_is_refused_naming_it(server):
    """The opening is refused (invalid_event, close 1008) with a message naming the field (and, for a value
    out of range, the server's limit)."""
    srv, _ = server(max_call_s=2.0)
    messages = {}
    for value in BAD_LIMITS:
        msgs, _, close = asyncio.run(native_call(srv.ws_url, '{"type": "start", "max_call_s": ' + value + "}", None))
        assert msgs[-1]["code"] == "invalid_event" and "max_call_s" in msgs[-1]["message"], (value, msgs)
        assert close == 1008
        messages[value] = msgs[-1]["message"]
    assert "engine.max_call_s = 2 s" in messages["2.5"] and "engine.max_call_s = 2 s" in messages["0"]
    srv.wait_idle()


def test_an_upload_max_call_s_is_checked_and_its_audio_held_to_it(server):
    """POST /generate: a max_call_s field that is not a number, or out of range, is 400 naming it; audio longer
    than the upload's own max_call_s is refused up front (413 call_too_long naming that limit)."""
    srv, _ = server(max_call_s=2.0)
    body = wav_bytes(tone(1.0))

    async def go():
        out = []
        async with aiohttp.ClientSession() as http:
            for value in ("x", "0", "2.5", "nan"):
                async with http.post(f"{srv.url}/generate", params={"max_call_s": value}, data=body) as r:
                    out.append((r.status, await r.json()))
            async with http.post(f"{srv.url}/generate", params={"max_call_s": "0.5"}, data=body) as r:
                out.append((r.status, await r.json()))
        return out

    *bad, (status, too_long) = asyncio.run(go())
    assert [(s, b["code"]) for s, b in bad] == [(400, "invalid_event")] * 4, bad
    assert all("max_call_s" in b["param"] for _, b in bad)
    assert status == 413 and too_long["code"] == "call_too_long", too_long
    assert "own max_call_s = 0.5 s" in too_long["message"]
    srv.wait_idle()


@pytest.mark.parametrize("protocol", ["realtime", "native", "upload"])
def test_a_declared_max_call_s_reaches_the_engine_call(server, monkeypatch, protocol):
    """A number within the server's limit (an integer too) is the engine call's CallOptions.max_call_s; the
    session echoes it (Realtime session.updated, native `started` limits) and the call completes."""
    srv, _ = server(max_call_s=2.0)
    opened = spy_open_call(monkeypatch, srv)
    if protocol == "realtime":
        events, close = asyncio.run(realtime(srv.ws_url, tone(0.4), chunk=FRAME_IN, session={"max_call_s": 1}))
        assert errors(events) == [] and close == 1000 and len(frames_of(events)) == 5
        assert "max_call_s" not in events[0]["session"]                          # session.created: not set
        assert [e["session"].get("max_call_s") for e in events if e["type"] == "session.updated"] == [None, 1.0]
        assert events[0]["session"]["capabilities"]["max_call_s"] == 2.0        # the server's limit, as before
    elif protocol == "native":
        msgs, packets, close = asyncio.run(native_call(srv.ws_url, '{"type": "start", "max_call_s": 1.5}',
                                                       pcm16(tone(0.4))))
        assert msgs[0]["type"] == "started" and msgs[0]["limits"]["max_call_s"] == 1.5
        assert msgs[-1] == {"type": "ended", "reason": "completed"} and packets == 5 and close == 1000
    else:
        async def upload():
            async with aiohttp.ClientSession() as http, \
                    http.post(f"{srv.url}/generate?max_call_s=1.5", data=wav_bytes(tone(0.4))) as r:
                return r.status, [json.loads(line) async for line in r.content if line.strip()]
        status, lines = asyncio.run(upload())
        assert status == 200 and lines[0]["limits"]["max_call_s"] == 1.5
        assert lines[-1] == {"type": "ended", "reason": "completed"}
    assert [o.max_call_s for o in opened] == [1.5 if protocol != "realtime" else 1.0]
    assert isinstance(opened[0].max_call_s, float)
    srv.wait_idle()


@pytest.mark.parametrize("protocol", ["realtime", "native"])
def test_call_too_long_names_the_limit_the_call_declared(server, protocol):
    """A call that declared its own max_call_s and reached it is told that limit, not only the server's
    (here both are 0.4 s, so the engine ends the call at 0.4 s however it applies the call's own limit)."""
    srv, _ = server(max_call_s=0.4)
    if protocol == "realtime":
        events, close = asyncio.run(realtime(srv.ws_url, tone(1.5), chunk=FRAME_IN, pace=0.005,
                                             session={"max_call_s": 0.4}))
        assert errors(events) == ["call_too_long"] and len(frames_of(events)) == 5
        message = refusal(events)["message"]
    else:
        msgs, packets, close = asyncio.run(native_call(srv.ws_url, '{"type": "start", "max_call_s": 0.4}',
                                                       pcm16(tone(1.5))))
        assert msgs[-1]["code"] == "call_too_long" and packets == 5
        message = msgs[-1]["message"]
    assert close == 1008
    assert "own max_call_s = 0.4 s" in message and "engine.max_call_s is 0.4 s" in message, message
    srv.wait_idle()
