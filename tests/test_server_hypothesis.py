"""Property-based fuzzing (hypothesis) of both WebSocket protocols and of upload bodies, against one real server
on the scripted frame step (tests/server_support.py). Hypothesis draws event sequences with every field of
any JSON type (lone surrogates, huge and non-finite numbers, nested junk included), native openings and
binary messages, upload bodies and content types, and reconnects (`?resume=`) with any query. The invariant: every server message is a JSON event and
the connection ends with a documented close code (or, for an upload, a documented HTTP status with a JSON
body); nothing is logged at error level; and afterwards the server holds no call and serves the next one."""
from __future__ import annotations

import asyncio
import base64
import json
import logging

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_support import assert_recovers, make, tone, wav_bytes

REALTIME_TYPES = ["session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                  "input_audio_buffer.clear", "conversation.item.create", "response.cancel", "response.create",
                  "session.ping", "conversation.item.delete", "transcription_session.update", "no.such.event"]
CLOSE_CODES = {1000, 1008, 1009, 1013}       # normal, a fatal error, message too big, busy
HTTP_STATUSES = {200, 400, 401, 403, 409, 413, 503}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2 ** 70, max_value=2 ** 70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3),
    max_leaves=8)
pcm_b64 = st.binary(max_size=3000).map(lambda b: base64.b64encode(b).decode())
_session_fields = {k: json_values for k in ("instructions", "tools", "voice", "seed", "temperature", "top_p",
                                            "repetition_penalty", "output_modalities", "input_audio_format",
                                            "output_audio_format", "max_call_s")}
_audio = st.fixed_dictionaries({}, optional={
    "input": st.fixed_dictionaries({}, optional={"format": json_values}),
    "output": st.fixed_dictionaries({}, optional={"format": json_values, "voice": json_values})})
session = st.fixed_dictionaries({}, optional={**_session_fields, "audio": _audio})
realtime_event = st.fixed_dictionaries({"type": st.sampled_from(REALTIME_TYPES)}, optional={
    "session": session | json_values, "audio": pcm_b64 | json_values, "item": json_values,
    "final": json_values, "event_id": json_values})
opening = st.fixed_dictionaries({"type": st.just("start") | json_values}, optional={
    k: json_values for k in ("prompt", "tools", "seed", "temperature", "voice", "call_id", "sample_rate", "channels",
                             "format", "output_format", "output_sample_rate", "tokens", "max_call_s")})


def _logged_errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def _messages(ws) -> list:
    out = []
    async for m in ws:
        if m.type == aiohttp.WSMsgType.TEXT:
            ev = json.loads(m.data)
            assert isinstance(ev, dict) and isinstance(ev.get("type"), str), m.data[:200]
            out.append(ev)
    return out


async def _close_code(url: str, send) -> int:
    """A socket to `url`: `await send(ws)` (the server may close it meanwhile: sending stops), every server
    message read (each must be a JSON event) -> the close code."""
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url, max_msg_size=0) as ws:
            reader = asyncio.create_task(_messages(ws))
            try:
                await send(ws)
            except ConnectionError:
                pass
            await asyncio.wait_for(reader, 20)
            return ws.close_code


def test_hypothesis_fuzzes_both_protocols_and_uploads(monkeypatch, tok, caplog):
    srv, _ = make(monkeypatch, tok, max_calls=2, max_call_s=4.0, idle_timeout_s=2.0, max_message_kb=16,
                  max_upload_mb=0.25, max_pending_s=2.0)
    common = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))

    async def run_realtime(events, raw_tail):
        async def send(ws):
            for ev in events:
                await ws.send_str(json.dumps(ev))
            if raw_tail is not None:
                await ws.send_str(raw_tail)
            await ws.send_str(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        return await _close_code(f"{srv.ws_url}/v1/realtime", send)

    async def run_native(first, chunks, events):
        async def send(ws):
            await ws.send_str(json.dumps(first))
            for c in chunks:
                await ws.send_bytes(c)
            for ev in events:
                await ws.send_str(json.dumps(ev))
            await ws.send_str(json.dumps({"type": "end_input"}))
        return await _close_code(f"{srv.ws_url}/generate/ws", send)

    async def run_upload(body, content_type, query):
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{srv.url}/generate", params=query, data=body,
                                 headers={"Content-Type": content_type}) as r:
                data = await r.read()
                if r.status == 200:
                    lines = [json.loads(x) for x in data.splitlines() if x.strip()]
                    assert lines and lines[-1]["type"] in ("ended", "error")
                else:
                    assert json.loads(data)["type"] == "error"
                return r.status

    @settings(max_examples=40, **common)
    @given(events=st.lists(realtime_event, max_size=6),
           raw_tail=st.none() | st.text(max_size=60) | st.sampled_from(['{"type": "session.update", "session": '
                                                                        '{"instructions": "\\ud800"}}', "[1,2", "null"]))
    def realtime_calls(events, raw_tail):
        assert asyncio.run(run_realtime(events, raw_tail)) in CLOSE_CODES

    @settings(max_examples=30, **common)
    @given(first=opening, chunks=st.lists(st.binary(max_size=3000), max_size=4),
           events=st.lists(st.fixed_dictionaries({"type": st.sampled_from(["tool_output", "abort", "end_input", "x"])},
                                                 optional={"call_id": json_values, "output": json_values}), max_size=3))
    def native_calls(first, chunks, events):
        assert asyncio.run(run_native(first, chunks, events)) in CLOSE_CODES

    wav = wav_bytes(tone(0.3))

    @settings(max_examples=30, **common)
    @given(body=st.binary(max_size=2000) | st.integers(0, len(wav)).map(lambda n: wav[:n])
           | st.tuples(st.integers(0, 60), st.binary(min_size=1, max_size=8)).map(
               lambda t: wav[:t[0]] + t[1] + wav[t[0] + len(t[1]):]),
           content_type=st.sampled_from(["audio/wav", "multipart/form-data", "multipart/form-data; boundary=x",
                                         "text/plain", "application/octet-stream"]),
           query=st.dictionaries(st.sampled_from(["seed", "prompt", "call_id", "temperature", "tokens", "voice",
                                                  "max_call_s"]),
                                 st.text(max_size=20), max_size=3))
    def uploads(body, content_type, query):
        assert asyncio.run(run_upload(body, content_type, query)) in HTTP_STATUSES

    async def run_resume(path, query):
        async with aiohttp.ClientSession() as http:
            try:
                async with http.ws_connect(f"{srv.ws_url}{path}", params=query):
                    return 101
            except aiohttp.WSServerHandshakeError as e:
                return e.status

    @settings(max_examples=30, **common)
    @given(path=st.sampled_from(["/v1/realtime", "/generate/ws"]),
           query=st.fixed_dictionaries({"resume": st.text(max_size=40)}, optional={
               "received": st.text(max_size=16) | st.sampled_from(["\u00b2", "\u0663", "1e3", " 1"])
               | st.integers(-2 ** 70, 2 ** 70).map(str), "call_id": st.text(max_size=8)}))
    def resumes(path, query):   # no such call: refused before the upgrade, whatever the query holds
        assert asyncio.run(run_resume(path, query)) in (400, 404)

    async def run_mint(body: bytes):
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{srv.url}/v1/realtime/client_secrets", data=body,
                                 headers={"Content-Type": "application/json"}) as r:
                answer = json.loads(await r.read())
                assert answer["value"].startswith("ek_") if r.status == 200 else answer["type"] == "error"
                return r.status

    @settings(max_examples=30, **common)
    @given(body=st.fixed_dictionaries({}, optional={
        "expires_after": json_values | st.fixed_dictionaries({}, optional={"anchor": json_values,
                                                                           "seconds": json_values}),
        "session": session | json_values}).map(lambda d: json.dumps(d).encode())
        | st.binary(max_size=200) | st.text(max_size=60).map(str.encode))
    def mints(body):   # a secret, or an error naming the field: never a 500
        assert asyncio.run(run_mint(body)) in (200, 400)

    try:
        with caplog.at_level(logging.ERROR):
            realtime_calls()
            native_calls()
            uploads()
            resumes()
            mints()
            assert_recovers(srv)
        assert _logged_errors(caplog) == []
    finally:
        srv.close()
