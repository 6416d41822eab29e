"""Server protocol, limits and refusals over real loopback sockets, on the real Engine with a scripted
frame step (tests/server_support.py): scripted tokens make turns, tool calls and packet order exact.
The same server runs the tiny model in test_server_model.py. One file past 500 lines on purpose: both
protocols' happy paths over one scripted server (hostile input is tests/test_server_edges.py)."""
from __future__ import annotations

import asyncio
import base64
import gc
import json
import struct
import time

import aiohttp
import numpy as np
import pytest

from nemo_duplex.server.tools import parse_tool_calls, render_tool_prompt, tool_response_ids
from tests.server_support import (
    NATIVE,
    ScriptedModel,
    b64,
    frames_of,
    make,
    realtime,
    tiny_rnnt,
    tone,
    wav_bytes,
)

FRAME_IN, FRAME_OUT = 1280, 1764
TOOLCALL = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'


def scripted(tok, **text):
    """text tokens of a turn: BOS at frame 1, the words, EOS, then PAD."""
    t = ScriptedModel().cfg.tokens
    return [t.pad_id, t.bos_id] + tok.encode(text.get("say", "hello there")) + [t.eos_id]


def errors(events):
    return [e["error"]["code"] for e in events if e["type"] == "error"]


async def realtime_session(http, ws_url: str):
    """A Realtime socket whose session.created has arrived (it holds a place)."""
    ws = await http.ws_connect(f"{ws_url}/v1/realtime")
    assert json.loads((await ws.receive()).data)["type"] == "session.created"
    return ws


# ---- pure pieces ---------------------------------------------------------------------------------------
def test_parse_tool_calls_and_prompt(tok):
    assert parse_tool_calls(TOOLCALL) == [("get_weather", '{"city": "Paris"}')]
    assert parse_tool_calls('<TOOLCALL>[{"name": "a", "arguments": "{\\"x\\": 1}"}]</TOOLCALL>') == [("a", '{"x": 1}')]
    for bad in ("<TOOLCALL>[{]</TOOLCALL>", "[{}]", '<TOOLCALL>[{"arguments": {}}]</TOOLCALL>', "<TOOLCALL>[]</TOOLCALL>"):
        with pytest.raises(ValueError):
            parse_tool_calls(bad)
    p = render_tool_prompt("Be brief.", [{"name": "get_weather", "description": "weather",
                                          "parameters": {"type": "object"}, "on_hold_message": "One moment."}])
    assert p.startswith("Be brief. You can use the following tools to assist the user if required: <AVAILABLE_TOOLS>[")
    listed = json.loads(p.split("<AVAILABLE_TOOLS>")[1].split("</AVAILABLE_TOOLS>")[0])
    assert listed == [{"description": "weather", "name": "get_weather", "on_hold_message": "One moment.",
                       "parameters": {"type": "object"}}]
    assert 'say: "One moment."' in p
    ids = tool_response_ids(tok, '{"temp": 21}', 1024)
    assert tok.decode(ids) == '<TOOL_RESPONSE>[{"temp": 21}]</TOOL_RESPONSE>'
    assert tok.decode(tool_response_ids(tok, "sunny", 1024)) == '<TOOL_RESPONSE>["sunny"]</TOOL_RESPONSE>'


# ---- a whole Realtime call ----------------------------------------------------------------------------
def test_realtime_call_in_order(server, tok):
    srv, model = server()
    model.text[3] = scripted(tok, say="hello there")
    model.user[3] = {2: [14], 4: [15, 16]}     # RNN-T ids of the tiny vocabulary
    audio = tone(1.0)
    session = {"instructions": "You are Aria.", "seed": 3, "temperature": 0.0,
               "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}},
                         "output": {"format": {"type": "audio/pcm", "rate": 22050}, "voice": "Aria"}}}
    events, code = asyncio.run(realtime(srv.ws_url, audio, chunk=1000, session=session, native=False))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "session.created" and kinds[1] == "session.updated", kinds[:3]
    caps = events[0]["session"]["capabilities"]
    assert caps["chunk_period_ms"] == 80 and caps["input_frame_samples"] == FRAME_IN
    assert events[1]["session"]["instructions"] == "You are Aria." and events[1]["session"]["seed"] == 3
    n_frames = -(-audio.size // FRAME_IN)
    pk = frames_of(events)
    assert len(pk) == n_frames and all(p.size == FRAME_OUT for p in pk)
    assert [int(p[0]) for p in pk] == list(range(n_frames))   # every packet, in order
    assert all(int(p[1]) == 3 for p in pk)                     # this call's (seed 3) packets only
    assert all(int(p[2]) > 0 for p in pk[:-1])                 # the input reached every step
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    assert text == "hello there"
    done = [e for e in events if e["type"] == "response.done"]
    assert done[0]["response"]["status"] == "completed"
    assert done[0]["response"]["output"][0]["content"][0]["transcript"] == "hello there"
    user = "".join(e["delta"] for e in events if e["type"] == "conversation.item.input_audio_transcription.delta")
    assert user == tiny_rnnt().decode([14, 15, 16])
    assert [e["frames"] for e in events if e["type"] == "input_audio_buffer.drained"] == [n_frames]
    assert kinds[-1] == "session.closed" and code == 1000
    assert model.prompts[-1] == [1] + tok.encode("You are Aria.") + [2]
    assert not errors(events)
    srv.wait_idle()


def test_tool_call_round_trip(server, tok):
    srv, model = server(tool_on_hold_min_frames=3)
    t = model.cfg.tokens
    start, end = tok.token_to_id(t.tool_call_start), tok.token_to_id(t.tool_call_end)
    call = [start] + tok.encode(TOOLCALL) + [end]
    bad = [start] + tok.encode("<TOOLCALL>[{oops</TOOLCALL>") + [end]
    model.func[5] = [t.pad_id] + bad + [t.pad_id] + call   # a malformed call first; the call goes on
    frames_call_done = len(model.func[5]) - 1             # frame index of the good call's <SPECIAL_21>
    want = tool_response_ids(tok, '{"temp": 21}', 1024)
    audio = tone(0.08 * (len(model.func[5]) + len(want) + 30))
    answered = []

    async def on_event(ev, ws):
        if ev["type"] == "response.function_call_arguments.done" and not answered:
            answered.append(ev)
            await ws.send_json({"type": "conversation.item.create",
                                "item": {"type": "function_call_output", "call_id": ev["call_id"],
                                         "output": '{"temp": 21}'}})
            await ws.send_json({"type": "conversation.item.create",   # the same call answered twice
                                "item": {"type": "function_call_output", "call_id": ev["call_id"], "output": "x"}})
            await ws.send_json({"type": "conversation.item.create",
                                "item": {"type": "function_call_output", "call_id": "nope", "output": "x"}})

    tools = [{"type": "function", "name": "get_weather", "description": "weather", "parameters": {},
              "on_hold_message": "Let me check."}]
    events, _ = asyncio.run(realtime(srv.ws_url, audio, chunk=FRAME_IN, pace=0.02,
                                     session={"seed": 5, "tools": tools}, on_event=on_event))
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0]["name"] == "get_weather" and json.loads(done[0]["arguments"]) == {"city": "Paris"}
    assert any(e["type"] == "response.function_call_arguments.delta" and e["call_id"] == done[0]["call_id"]
               for e in events)
    assert errors(events) == ["function_call_parse_error", "duplicate_function_call_output", "unknown_function_call"]
    forced = [(k, tok_id) for seed, k, tok_id in model.forced if seed == 5]
    assert [tok_id for _, tok_id in forced] == want                       # injected whole, in order
    ks = [k for k, _ in forced]
    assert ks == list(range(ks[0], ks[0] + len(want)))                    # one per frame
    assert ks[0] >= frames_call_done + 1 + 3                              # not before the on-hold frames
    assert "Let me check." in tok.decode(model.prompts[-1][1:-1])
    assert events[-1]["type"] == "session.closed"
    srv.wait_idle()


def test_response_cancel_fences_the_turn(server, tok):
    srv, model = server()
    t = model.cfg.tokens
    model.text[0] = [t.bos_id] + tok.encode("one two three four five six") + [t.eos_id, t.pad_id,
                                                                                 t.bos_id] + tok.encode("seven") + [t.eos_id]
    cancelled = []

    async def on_event(ev, ws):
        if ev["type"] == "response.output_audio_transcript.delta" and not cancelled:
            cancelled.append(ev["response_id"])
            await ws.send_json({"type": "response.cancel"})

    audio = tone(0.08 * (len(model.text[0]) + 4))
    events, _ = asyncio.run(realtime(srv.ws_url, audio, chunk=FRAME_IN, pace=0.02, on_event=on_event))
    done = {e["response"]["id"]: e["response"]["status"] for e in events if e["type"] == "response.done"}
    assert done[cancelled[0]] == "cancelled"
    after = [e for e in events if e["type"] == "response.output_audio_transcript.delta"
             and e["response_id"] == cancelled[0]]
    late = [e for e in after if events.index(e) > next(i for i, x in enumerate(events) if x["type"] == "response.done")]
    assert not late                                        # nothing of the fenced turn after the cancel
    later_text = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"
                         and e["response_id"] != cancelled[0])
    assert later_text == "seven"                          # the next turn comes through
    srv.wait_idle()


# ---- refusals and edge cases ---------------------------------------------------------------------------
def test_busy_refusal_frees_nothing_and_recovers(server, tok):
    srv, _ = server(max_calls=2)

    async def go():
        async with aiohttp.ClientSession() as http:
            a, b = await realtime_session(http, srv.ws_url), await realtime_session(http, srv.ws_url)
            c = await http.ws_connect(f"{srv.ws_url}/v1/realtime")
            ev = json.loads((await c.receive()).data)
            assert ev["type"] == "error" and ev["error"]["code"] == "busy" and ev["error"]["type"] == "rate_limit_error"
            assert "engine.max_calls" in ev["error"]["message"]
            await c.receive()
            assert c.close_code == 1013
            r = await http.post(f"{srv.url}/generate", data=wav_bytes(tone(0.2)))
            assert r.status == 503 and (await r.json())["code"] == "busy"
            await a.close()
            for _ in range(100):
                if len(srv.server.sessions) < 2:
                    break
                await asyncio.sleep(0.02)
            await (await realtime_session(http, srv.ws_url)).close()
            await b.close()

    asyncio.run(go())
    srv.wait_idle()
    metrics = asyncio.run(get_text(f"{srv.url}/metrics"))
    assert 'duplex_refusals_total{reason="busy"} 2.0' in metrics


async def get_text(url):
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as r:
            return await r.text()


def test_call_too_long(server, tok):
    srv, _ = server(max_call_s=0.4)
    events, code = asyncio.run(realtime(srv.ws_url, tone(1.5), chunk=FRAME_IN, pace=0.005))
    assert errors(events) == ["call_too_long"] and code == 1008
    assert "engine.max_call_s = 0.4 s" in [e for e in events if e["type"] == "error"][0]["error"]["message"]
    assert len(frames_of(events)) == 5
    srv.wait_idle()


def test_input_budget_exceeded(server, tok):
    srv, model = server(max_pending_s=0.4)
    model.step_s = 0.05
    events, code = asyncio.run(realtime(srv.ws_url, tone(2.0), chunk=16000))
    assert errors(events) == ["input_budget_exceeded"] and code == 1008, (code, [e["type"] for e in events])
    assert "engine.max_pending_s" in [e for e in events if e["type"] == "error"][0]["error"]["message"]
    srv.wait_idle()


def test_append_after_end_and_bad_events(server, tok):
    srv, model = server()
    model.step_s = 0.25  # the two frames take >= 0.5 s to drain: the messages sent after the final commit
    #                      are answered before the call ends and the socket closes
    after = [
        json.dumps({"type": "input_audio_buffer.append", "audio": b64(tone(0.1))}),
        json.dumps({"type": "input_audio_buffer.commit", "final": True}),
    ]

    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(f"{srv.ws_url}/v1/realtime") as ws:
                await ws.send_json({"type": "session.update", "session": NATIVE})
                await ws.send_json({"type": "session.update", "event_id": "c1", "bogus": None,
                                    "session": {"instructions": None, "unknown_field": 1, "seed": 1}})
                await ws.send_str("not json")
                await ws.send_json({"type": "no.such.event", "event_id": "c2"})
                await ws.send_json({"type": "input_audio_buffer.append", "audio": None})
                await ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()})
                await ws.send_bytes(b"\x00\x01")
                await ws.send_json({"type": "session.update", "session": {"seed": "x"}})
                await ws.send_json({"type": "session.update", "session": {"voice": "Nobody"}})
                await ws.send_json({"type": "session.update", "session": {"top_p": 0.0}})
                await ws.send_json({"type": "response.create"})        # a no-op here
                await ws.send_str(after[0])
                # audio has started: settings are locked (sent before the final commit, so the reply
                # cannot race the call's end and the socket's close)
                await ws.send_json({"type": "session.update", "session": {"seed": 2}})
                await ws.send_str(after[1])
                for raw in after:
                    await ws.send_str(raw)
                events = [json.loads(m.data) async for m in ws if m.type == aiohttp.WSMsgType.TEXT]
                return events

    events = asyncio.run(go())
    assert errors(events) == ["invalid_event", "unknown_event", "invalid_event", "invalid_audio", "invalid_event",
                              "invalid_event", "unknown_voice", "invalid_sampling", "session_locked",
                              "append_after_end", "append_after_end"]
    unknown = [e for e in events if e["type"] == "error" and e["error"]["code"] == "unknown_event"][0]
    assert unknown["error"]["event_id"] == "c2"
    assert [e["type"] for e in events].count("session.updated") == 2   # NATIVE, then c1
    assert events[-1]["type"] == "session.closed"              # the call still completed
    assert len(frames_of(events)) == 2
    srv.wait_idle()


def test_audio_format_refusals(server, tok):
    """Formats outside what the server converts are refused with invalid_audio_format naming the field; the
    session goes on (formats it takes: tests/test_audio.py, test_realtime_formats.py)."""
    srv, _ = server()
    bad_sessions = [
        {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 12345}}}},
        {"audio": {"input": {"format": {"type": "audio/pcmu", "rate": 16000}}}},
        {"audio": {"output": {"format": {"type": "audio/opus"}}}},
        {"input_audio_format": "g729"},
    ]
    events, _ = asyncio.run(realtime(srv.ws_url, None, final=False, native=False,
                                     extra=[{"type": "session.update", "session": s} for s in bad_sessions]
                                     + [{"type": "input_audio_buffer.append", "audio": b64(tone(0.1)),
                                         "sample_rate": 16000},   # the session's input is 24 kHz
                                        {"type": "session.close"}]))
    refused = [e["error"] for e in events if e["type"] == "error"]
    assert [e["code"] for e in refused] == ["invalid_audio_format"] * 5
    assert "12345 Hz" in refused[0]["message"] and "8000" in refused[1]["message"]
    assert refused[2]["param"] == "session.audio.output.format.type" and "24000 Hz" in refused[4]["message"]
    assert events[-1]["type"] == "session.closed"

    async def uploads():
        out = []
        async with aiohttp.ClientSession() as http:
            for body in (wav_bytes(tone(0.3), rate=12345), b"RIFF-not-a-wav"):
                async with http.post(f"{srv.url}/generate", data=body) as r:
                    out.append((r.status, (await r.json())["code"], (await r.json())["message"]))
        return out

    res = asyncio.run(uploads())
    assert [(s, c) for s, c, _ in res] == [(400, "invalid_audio_format")] * 2
    assert "12345 Hz" in res[0][2] and "not a PCM WAV" in res[1][2]
    srv.wait_idle()


def test_upload_streams_and_upload_limits(server, tok):
    srv, model = server(max_upload_mb=0.05, max_upload_s=1.0, max_call_s=1.2)
    model.text[0] = scripted(tok, say="ok")

    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{srv.url}/generate?seed=0&prompt=Hi", data=wav_bytes(tone(0.9))) as r:
                assert r.status == 200 and r.headers["Content-Type"] == "application/x-ndjson"
                lines = [json.loads(line) async for line in r.content if line.strip()]
            form = aiohttp.FormData()
            form.add_field("seed", "0")
            form.add_field("audio", wav_bytes(tone(0.5)), filename="a.wav", content_type="audio/wav")
            async with http.post(f"{srv.url}/generate", data=form) as r:
                multi = [json.loads(line) async for line in r.content if line.strip()]
            too_big = await http.post(f"{srv.url}/generate", data=wav_bytes(tone(3.0)))
            srv.server.cfg.max_upload_mb = 1.0
            too_long = await http.post(f"{srv.url}/generate", data=wav_bytes(tone(1.1)))
            srv.server.cfg.max_upload_s = 5.0
            too_long_call = await http.post(f"{srv.url}/generate", data=wav_bytes(tone(1.3)))
            return lines, multi, [(x.status, (await x.json())["code"], (await x.json())["message"])
                                  for x in (too_big, too_long, too_long_call)]

    lines, multi, refused = asyncio.run(go())
    assert lines[0]["type"] == "started" and lines[-1] == {"type": "ended", "reason": "completed"}
    audio = [x for x in lines if x["type"] == "audio"]
    assert [a["frame"] for a in audio] == list(range(-(-int(0.9 * 16000) // FRAME_IN)))
    assert [int(np.frombuffer(base64.b64decode(a["pcm16"]), "<i2")[0]) for a in audio] == [a["frame"] for a in audio]
    assert "".join(x["delta"] for x in lines if x["type"] == "text") == "ok"
    assert [x["type"] for x in lines].count("drained") == 1
    assert multi[-1]["reason"] == "completed" and len([x for x in multi if x["type"] == "audio"]) == 7
    assert [(s, c) for s, c, _ in refused] == [(413, "upload_too_large"), (413, "upload_too_long"),
                                                (413, "call_too_long")]
    assert "serve.max_upload_mb" in refused[0][2] and "serve.max_upload_s" in refused[1][2]
    assert "engine.max_call_s" in refused[2][2]
    srv.wait_idle()


def test_wav_cut_inside_a_sample_decodes_its_whole_samples():
    """nemo_duplex.audio.decode_wav on a WAV cut short at an odd byte (a broken transfer): the whole
    samples before the cut, equal to the file's (np.frombuffer raised on the odd byte, a 500 on upload)."""
    from nemo_duplex.audio import decode_wav

    full = wav_bytes(tone(0.3))
    whole = decode_wav(full)
    cut = decode_wav(full[:1001])                        # 44-byte header + 957 bytes: 478 samples and a half
    assert cut.shape == ((1001 - 44) // 2,)
    np.testing.assert_array_equal(cut, whole[:cut.shape[0]])


def test_malformed_multipart_upload_is_a_clear_400(server, tok):
    """A multipart upload without a boundary, or whose body breaks off inside a part, is refused with
    400 invalid_upload (aiohttp's parser raised into the handler: a 500 and an error in the log), and the
    server takes the next upload."""
    srv, _ = server()

    async def go():
        async with aiohttp.ClientSession() as http:
            out = []
            for ctype, body in (("multipart/form-data", b"--x\r\n"),
                                ("multipart/form-data; boundary=b", b"--b\r\nContent-Disposition: form-data; "
                                 b'name="audio"\r\n\r\nRIFF')):
                async with http.post(f"{srv.url}/generate", data=body, headers={"Content-Type": ctype}) as r:
                    out.append((r.status, (await r.json())["code"]))
            async with http.post(f"{srv.url}/generate", data=wav_bytes(tone(0.2))) as r:
                out.append((r.status, [json.loads(x) async for x in r.content if x.strip()][-1]["type"]))
            return out

    assert asyncio.run(go()) == [(400, "invalid_upload"), (400, "invalid_upload"), (200, "ended")]
    srv.wait_idle()


def test_hang_up_before_audio_and_idle_timeout(server, tok):
    srv, _ = server(idle_timeout_s=0.5)

    async def go():
        async with aiohttp.ClientSession() as http:
            await (await realtime_session(http, srv.ws_url)).close()
            assert srv.server.engine.active_calls == 0
            idle = await http.ws_connect(f"{srv.ws_url}/v1/realtime")
            events = [json.loads(m.data) async for m in idle if m.type == aiohttp.WSMsgType.TEXT]
            return events

    events = asyncio.run(go())
    assert errors(events) == ["idle_timeout"]
    srv.wait_idle()


def test_call_id_in_use_and_abort_recovery(server, tok):
    srv, model = server()

    async def go():
        async with aiohttp.ClientSession() as http:
            a = await http.ws_connect(f"{srv.ws_url}/v1/realtime?call_id=abc")
            await a.receive()
            await a.send_json({"type": "input_audio_buffer.append", "audio": b64(tone(0.5))})
            for path in ("/v1/realtime", "/generate/ws"):
                with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                    await http.ws_connect(f"{srv.ws_url}{path}?call_id=abc")
                assert e.value.status == 409
            r = await http.post(f"{srv.url}/generate?call_id=abc", data=wav_bytes(tone(0.2)))
            assert r.status == 409 and (await r.json())["code"] == "call_id_in_use"
            n = await http.ws_connect(f"{srv.ws_url}/generate/ws")
            await n.send_json({"type": "start", "call_id": "abc"})
            ev = json.loads((await n.receive()).data)
            assert ev["code"] == "call_id_in_use" and ev["status"] == 409
            # wait until a's call is producing, then abort it mid-call by dropping the socket
            while True:
                ev = json.loads((await a.receive()).data)
                if ev["type"] == "response.output_audio.delta":
                    break
            await a.close()

    asyncio.run(go())
    srv.wait_idle()
    # recovery: the same id starts a fresh call, frame 0 first
    events, code = asyncio.run(realtime(srv.ws_url, tone(0.3), query="?call_id=abc"))
    assert code == 1000 and [int(p[0]) for p in frames_of(events)] == [0, 1, 2, 3]
    assert events[0]["session"]["id"] == "abc"
    srv.wait_idle()


def test_prompt_longer_than_the_limit_is_refused_when_it_is_set(server, tok):
    """A system prompt over engine.max_prompt_tokens (600 words, > 512 tokens) is refused with
    prompt_too_long naming the limit when it is set: on /v1/realtime session.update answers an error and
    the session keeps its settings (a short prompt then runs the call); the native opening and an upload
    are refused (400). Before, the engine found it at admission and ended the call as an engine error."""
    srv, model = server()
    long_prompt = " ".join(f"word{i}" for i in range(600))
    assert model.prompt_ids(tok, long_prompt).numel() > 512

    events, code = asyncio.run(realtime(srv.ws_url, tone(0.3), chunk=FRAME_IN, session={"instructions": long_prompt},
                                        extra=[{"type": "session.update", "session": {"instructions": "Hi"}}]))
    refused = [e["error"] for e in events if e["type"] == "error"]
    assert [r["code"] for r in refused] == ["prompt_too_long"]
    assert "engine.max_prompt_tokens = 512" in refused[0]["message"]
    assert code == 1000 and len(frames_of(events)) == 4
    assert model.prompts[-1] == [1] + tok.encode("Hi") + [2]

    async def native_and_upload():
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(f"{srv.ws_url}/generate/ws") as ws:
                await ws.send_json({"type": "start", "prompt": long_prompt})
                opening = json.loads((await ws.receive()).data)
            async with http.post(f"{srv.url}/generate", data=wav_bytes(tone(0.2)),
                                 params={"prompt": long_prompt}) as r:
                upload = (r.status, (await r.json())["code"])
            return opening, upload

    opening, upload = asyncio.run(native_and_upload())
    assert opening["type"] == "error" and opening["code"] == "prompt_too_long"
    assert upload == (400, "prompt_too_long")
    # more characters than 512 tokens can cover: refused by its length alone, the message says so
    huge = "x" * (512 * srv.server.engine.longest_token + 1)
    events, code = asyncio.run(realtime(srv.ws_url, tone(0.2), chunk=FRAME_IN, session={"instructions": huge}))
    refused = [e["error"] for e in events if e["type"] == "error"]
    assert [r["code"] for r in refused] == ["prompt_too_long"] and "characters" in refused[0]["message"]
    assert code == 1000
    srv.wait_idle()


def test_native_ws(server, tok):
    srv, model = server()
    model.text[9] = scripted(tok, say="hi")
    # Steps slow enough that the call still has frames to step when the audio after end_input arrives: had
    # the engine stepped them all and ended the call first, the server would close the socket without
    # reading that audio, and the append_after_end error below would never come (seen once in CI).
    model.step_s = 0.05

    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(f"{srv.ws_url}/generate/ws") as ws:
                await ws.send_json({"type": "start", "seed": 9, "prompt": "Hello", "sample_rate": 16000})
                started = json.loads((await ws.receive()).data)
                pcm = (tone(0.7) * 32767).astype("<i2").tobytes()
                for i in range(0, len(pcm), 3000):
                    await ws.send_bytes(pcm[i:i + 3000])
                await ws.send_json({"type": "what"})
                await ws.send_json({"type": "end_input"})
                await ws.send_bytes(b"\x00\x00")
                packets, events = [], []
                async for m in ws:
                    if m.type == aiohttp.WSMsgType.BINARY:
                        packets.append(m.data)
                    else:
                        events.append(json.loads(m.data))
                return started, packets, events, ws.close_code

    started, packets, events, code = asyncio.run(go())
    assert started["type"] == "started" and started["output"]["sample_rate"] == 22050
    frames = [struct.unpack_from("<If", p)[0] for p in packets]
    assert frames == list(range(-(-int(0.7 * 16000) // FRAME_IN)))
    assert all(len(p) == 8 + 2 * FRAME_OUT for p in packets)
    assert [int(np.frombuffer(p[8:], "<i2")[1]) for p in packets] == [9] * len(packets)
    assert "".join(e["delta"] for e in events if e["type"] == "text") == "hi"
    assert [e["event"] for e in events if e["type"] == "turn"] == ["start", "end"]
    assert [e["code"] for e in events if e["type"] == "error"] == ["unknown_event", "append_after_end"]
    assert events[-1] == {"type": "ended", "reason": "completed"} and code == 1000
    assert model.prompts[-1] == [1] + tok.encode("Hello") + [2]
    srv.wait_idle()


async def _registered(srv, call_id: str, timeout_s: float = 30.0) -> None:
    """Until the server has taken the opening message of call `call_id` (it holds a place)."""
    t0 = time.monotonic()
    while call_id not in srv.server.sessions:
        assert time.monotonic() - t0 < timeout_s, f"call {call_id} never reached the server"
        await asyncio.sleep(0.01)


def test_slow_consumer_ends_only_its_call(server, tok):
    srv, model = server(max_outbound_frames=4, slow_consumer_grace_s=1.0)

    async def slow():
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(f"{srv.ws_url}/generate/ws", max_msg_size=0)
            conn = ws._response.connection
            sock = conn.transport.get_extra_info("socket")
            import socket as _s
            sock.setsockopt(_s.SOL_SOCKET, _s.SO_RCVBUF, 4096)
            await ws.send_json({"type": "start", "seed": 1, "call_id": "slow"})
            await _registered(srv, "slow")   # else "not in sessions" below could mean "not there yet"
            conn.transport.pause_reading()                           # stop reading, keep sending
            pcm = (tone(8.0) * 32767).astype("<i2").tobytes()
            for i in range(0, len(pcm), FRAME_IN * 2 * 10):
                try:
                    await ws.send_bytes(pcm[i:i + FRAME_IN * 20])
                except ConnectionError:
                    break
                await asyncio.sleep(0.05)
                if "slow" not in srv.server.sessions:
                    break
            for _ in range(200):
                if "slow" not in srv.server.sessions:
                    break
                await asyncio.sleep(0.05)
            gone = "slow" not in srv.server.sessions
            conn.transport.resume_reading()
            events = []
            try:
                async for m in ws:
                    if m.type == aiohttp.WSMsgType.TEXT:
                        events.append(json.loads(m.data))
            except Exception:
                pass
            return gone, events

    async def both():
        good = asyncio.create_task(realtime(srv.ws_url, tone(2.0), chunk=FRAME_IN, pace=0.01))
        gone, slow_events = await slow()
        return gone, slow_events, await good

    gone, slow_events, (good_events, good_code) = asyncio.run(both())
    assert gone
    codes = [e.get("code") for e in slow_events if e.get("type") == "error"]
    assert codes in ([], ["slow_consumer"])   # delivered if the pipe drained in time, else the socket was cut
    assert good_code == 1000 and len(frames_of(good_events)) == 25 and not errors(good_events)
    assert [int(p[0]) for p in frames_of(good_events)] == list(range(25))
    srv.wait_idle()
    assert 'duplex_refusals_total{reason="slow_consumer"} 1.0' in asyncio.run(get_text(f"{srv.url}/metrics"))


def test_client_that_stops_reading_after_its_call_ends_frees_its_place(server, tok):
    """A call ends normally (4 s of audio, end of input: 50 frames, under serve.max_outbound_frames, so
    never a slow consumer) while its client has stopped reading: the output fills the socket buffers
    and the writer would wait on them for ever, holding the server place. The socket is cut once a
    client reading at playback rate would have had it all (slow_consumer_grace_s + 80 ms per frame still
    queued at the end), and the place is free for the next call."""
    srv, model = server(slow_consumer_grace_s=1.0, max_calls=1)

    async def silent_reader():
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(f"{srv.ws_url}/generate/ws", max_msg_size=0)
            conn = ws._response.connection
            import socket as _s
            conn.transport.get_extra_info("socket").setsockopt(_s.SOL_SOCKET, _s.SO_RCVBUF, 4096)
            await ws.send_json({"type": "start", "seed": 1, "call_id": "deaf"})
            await _registered(srv, "deaf")   # else "not in sessions" below could mean "not there yet"
            conn.transport.pause_reading()
            await ws.send_bytes((tone(4.0) * 32767).astype("<i2").tobytes())
            await ws.send_json({"type": "end_input"})
            t0 = time.monotonic()
            while "deaf" in srv.server.sessions and time.monotonic() - t0 < 15:
                await asyncio.sleep(0.05)
            gone_after = time.monotonic() - t0
            conn.transport.resume_reading()
            return "deaf" not in srv.server.sessions, gone_after

    gone, gone_after = asyncio.run(silent_reader())
    assert gone and gone_after < 1.0 + 50 * 0.08 + 3.0   # grace + the frames a real-time reader takes + slack
    srv.wait_idle()
    events, code = asyncio.run(realtime(srv.ws_url, tone(0.4), chunk=FRAME_IN))   # the one place is free
    assert code == 1000 and len(frames_of(events)) == 5 and not errors(events)


def test_health_and_metrics(server, tok):
    srv, _ = server(engine_kwargs={"admission_gap_wait_ms": 80.0})   # (for duplex_admission_pieces_total)
    asyncio.run(realtime(srv.ws_url, tone(0.5)))

    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{srv.url}/health") as r:
                health = (r.status, await r.json())
            async with http.get(f"{srv.url}/metrics") as r:
                return health, await r.text()

    (status, body), metrics = asyncio.run(go())
    assert status == 200 and body["status"] == "ready"
    for name in ("duplex_active_calls 0.0", "duplex_frames_per_second", "duplex_step_seconds_bucket",
                 "duplex_frame_lag_seconds_bucket", "duplex_deadline_misses_total", "duplex_ready 1.0",
                 'duplex_calls_ended_total{reason="completed"}'):
        assert name in metrics, name
    lag_count = [line for line in metrics.splitlines() if line.startswith("duplex_frame_lag_seconds_count")][0]
    assert float(lag_count.split()[-1]) == 7.0     # 0.5 s = 7 frames, each observed once
    # the admission thread's pieces (the warm-up call's, the call's), with the gap rule on and no live call: in a gap
    in_gap = [line for line in metrics.splitlines() if line.startswith('duplex_admission_pieces_total{start="gap"}')]
    assert in_gap and float(in_gap[0].split()[-1]) >= 2.0, in_gap
    srv.server.ready = False
    status, _ = asyncio.run(_status(f"{srv.url}/health"))
    assert status == 503
    srv.server.ready = True
    # an admission thread on one call past engine.max_admission_s admits no one: 503, with how long
    srv.wait_idle()   # (no step or admission of the call above may reset the marks set here)
    admitter = srv.server.engine.admitter
    admitter.busy_since = time.monotonic() - srv.server.engine.cfg.max_admission_s - 5.0
    try:
        status, body = asyncio.run(_status(f"{srv.url}/health"))
    finally:
        admitter.busy_since = None
    assert status == 503 and body["status"] == "admission_stalled" and body["admission_stalled_s"] >= 5.0
    assert asyncio.run(_status(f"{srv.url}/health"))[0] == 200
    # ... and so is an engine whose step has been under way past engine.max_step_s (a wedged GPU)
    srv.server.engine.busy_since = time.monotonic() - srv.server.engine.cfg.max_step_s - 5.0
    try:
        status, body = asyncio.run(_status(f"{srv.url}/health"))
        metrics = asyncio.run(_text(f"{srv.url}/metrics"))
    finally:
        srv.server.engine.busy_since = None
    assert status == 503 and body["status"] == "engine_stalled" and body["engine_stalled_s"] >= 5.0
    stalled = [line for line in metrics.splitlines() if line.startswith('duplex_stalled_seconds{part="engine"}')]
    assert len(stalled) == 1 and float(stalled[0].split()[-1]) >= 5.0
    assert asyncio.run(_status(f"{srv.url}/health"))[0] == 200


def test_a_stall_is_logged_once_with_every_threads_stack(server, caplog):
    """Server._report_stalls (each second with the metrics): a step under way past engine.max_step_s gets
    one error naming it with every thread's stack (the engine thread's among them), not one a second."""
    import logging

    srv, _ = server()
    engine = srv.server.engine
    with caplog.at_level(logging.ERROR, logger="nemo_duplex.server"):
        engine.busy_since = time.monotonic() - engine.cfg.max_step_s - 5.0
        try:
            srv.server._report_stalls()
            srv.server._report_stalls()
        finally:
            engine.busy_since = None
        srv.server._report_stalls()
    stalls = [r.getMessage() for r in caplog.records if "engine_stalled" in r.getMessage()]
    assert len(stalls) == 1, stalls
    assert stalls[0].startswith("engine_stalled: under way") and "thread engine:" in stalls[0]
    assert srv.server._stalls_reported == set()


async def _status(url):
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as r:
            return r.status, await r.json()


async def _text(url):
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as r:
            return await r.text()


def test_not_ready_until_warm(monkeypatch, tok):
    model = ScriptedModel()
    model.capture_s = 1.5                       # graph capture takes a while
    gc.unfreeze()
    srv, _ = make(monkeypatch, tok, model=model, wait_ready=False)
    try:
        status, body = asyncio.run(_status(f"{srv.url}/health"))
        assert status == 503 and body["status"] == "starting" and gc.get_freeze_count() == 0
        events, code = asyncio.run(realtime(srv.ws_url, tone(0.2)))
        assert errors(events) == ["not_ready"] and code == 1008
        t0 = time.monotonic()
        while asyncio.run(_status(f"{srv.url}/health"))[0] != 200:
            assert time.monotonic() - t0 < 20
            time.sleep(0.05)
        assert gc.get_freeze_count() > 0  # the warm-up froze the start-up objects (out of the cyclic GC's scans)
        events, code = asyncio.run(realtime(srv.ws_url, tone(0.2)))
        assert code == 1000 and not errors(events)
        srv.wait_idle()
    finally:
        srv.close()


def test_upload_client_disconnect_frees_the_slot(server, tok):
    srv, model = server()
    model.step_s = 0.02

    async def go():
        async with aiohttp.ClientSession() as http:
            r = await http.post(f"{srv.url}/generate", data=wav_bytes(tone(4.0)))
            first = json.loads(await r.content.readline())
            second = json.loads(await r.content.readline())
            r.close()                                  # hang up mid-stream
            return first, second

    first, second = asyncio.run(go())
    assert first["type"] == "started" and second["type"] == "audio"
    srv.wait_idle()
    assert 'duplex_calls_ended_total{reason="hangup"} 1.0' in asyncio.run(get_text(f"{srv.url}/metrics"))


def test_call_script_writes_outputs(server, tok, tmp_path):
    import subprocess
    import sys
    import wave

    srv, model = server()
    model.text[2] = scripted(tok, say="see you")
    model.user[2] = {3: [14]}
    clip = tmp_path / "in.wav"
    clip.write_bytes(wav_bytes(tone(0.6)))
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "scripts/call.py", str(clip), "--fast", "--url", srv.url, "--seed", "2",
                          "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    with wave.open(str(out / "agent.wav")) as w:
        assert w.getframerate() == 22050 and w.getnframes() == 8 * FRAME_OUT
    assert (out / "agent.txt").read_text().strip() == "see you"
    assert (out / "user.txt").read_text().strip() == tiny_rnnt().decode([14])
    lag = (out / "lag.tsv").read_text().splitlines()
    assert lag[0] == "frame\tserver_lag_ms\tclient_lag_ms" and [int(x.split()[0]) for x in lag[1:]] == list(range(8))
    assert json.loads((out / "events.jsonl").read_text().splitlines()[-1]) == {"type": "ended", "reason": "completed"}
    srv.wait_idle()


def test_incremental_text_matches_whole_decode(tok):
    """Deltas of a long turn (folded every 16 ids) add up to the decode of the whole turn; the same for
    the RNN-T transcript, whose decoder strips a leading space."""
    from nemo_duplex.server.frames import IncrementalText

    rng = np.random.default_rng(0)
    ids = tok.encode("Hello, and thank you for calling. How can I help you today? The weather is sunny. " * 4)
    inc = IncrementalText(tok.decode, fold=16, keep=4)
    assert "".join(inc.add([i]) for i in ids) == tok.decode(ids)
    rv = tiny_rnnt()
    user = [int(x) for x in rng.integers(0, rv.vocab_size, 200)]
    inc = IncrementalText(rv.decode, fold=16, keep=4)
    got = ""
    for k in range(0, len(user), 3):
        got += inc.add(user[k:k + 3])
    assert got == rv.decode(user)
