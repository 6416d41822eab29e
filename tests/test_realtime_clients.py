"""What Realtime clients expect, on the real server with a scripted frame step (tests/server_support.py):
the Realtime audio formats (PCM16 at 24 kHz, G.711 at 8 kHz) converted to the model's rates, the events
clients wait on (speech started/stopped, cleared, item done, usage), the text-only modality, tools that
time out and on-hold messages that are spoken, the official OpenAI SDK at its defaults with a tool round
trip, and docs/protocol.md's event table against the code."""
from __future__ import annotations

import asyncio
import base64
import json
import re
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from nemo_duplex.audio import AudioFormat, decode_wav, g711_decode, resample
from nemo_duplex.server import realtime_protocol as rp
from nemo_duplex.server.tools import tool_response_ids
from tests.server_support import ScriptedModel, b64, tone, wav_bytes
from tests.test_server import FRAME_IN, TOOLCALL, errors, realtime

DOCS = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


def heard(model: ScriptedModel, seed: int) -> np.ndarray:
    return np.concatenate(model.heard[seed])


def audio_bytes(events) -> bytes:
    return b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")


async def call_with(url: str, session: dict, chunks: list[bytes], on_event=None, pace: float = 0.0):
    """A Realtime call whose audio is already in the session's wire format: one append per chunk, then the
    final commit. Returns the events."""
    events = []
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/realtime") as ws:
            await ws.send_json({"type": "session.update", "session": session})

            async def send():
                for c in chunks:
                    await ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(c).decode()})
                    if pace:
                        await asyncio.sleep(pace)
                await ws.send_json({"type": "input_audio_buffer.commit", "final": True})

            sender = asyncio.create_task(send())
            async for msg in ws:
                ev = json.loads(msg.data)
                events.append(ev)
                if on_event is not None:
                    await on_event(ev, ws)
            await sender
    return events


# ---- formats -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ["pcmu", "pcma"])
def test_g711_call_both_ways(server, encoding):
    """A telephony bridge's call: G.711 at 8 kHz in 20 ms messages, G.711 back. The step hears the
    one-shot 16 kHz resampling of the decoded input (within 2e-3: soxr's streaming and one-shot output
    differ by float rounding only, the rest is the resampler's end handling), and the reply is 8 kHz
    G.711, 640 bytes per 80 ms frame in all."""
    srv, model = server()
    fmt = AudioFormat(encoding, 8000)
    x = resample(tone(1.2, freq=440.0, amp=0.4), 16000, 8000)
    wire = fmt.encode(x)
    session = {"seed": 3, "audio": {"input": {"format": {"type": f"audio/{encoding}"}},
                                    "output": {"format": {"type": f"audio/{encoding}"}}}}
    events = asyncio.run(call_with(srv.ws_url, session, [wire[i:i + 160] for i in range(0, len(wire), 160)]))
    created = next(e for e in events if e["type"] == "session.updated")["session"]["audio"]
    assert created["input"]["format"] == created["output"]["format"] == {"type": f"audio/{encoding}", "rate": 8000}
    want = resample(g711_decode(wire, encoding), 8000, 16000)
    got = heard(model, 3)
    n = -(-want.size // FRAME_IN)
    assert got.size == n * FRAME_IN
    np.testing.assert_allclose(got[:want.size], want, atol=2e-3)
    assert not got[want.size:].any()                     # the last frame's zero padding
    out = audio_bytes(events)
    assert abs(len(out) - n * 640) <= 2                  # 1764 samples at 22.05 kHz = 640 at 8 kHz, per frame
    assert errors(events) == [] and events[-1]["type"] == "session.closed"
    srv.wait_idle()


def test_realtime_default_is_pcm16_at_24khz(server):
    """No format in the session: OpenAI's default, PCM16 at 24 kHz both ways; a message that ends inside
    a sample is refused naming the format, and the call goes on."""
    srv, model = server()
    x = resample(tone(0.8, amp=0.3), 16000, 24000)
    pcm = (x * 32767).astype("<i2").tobytes()
    events = asyncio.run(call_with(srv.ws_url, {"seed": 4}, [pcm[:4801], pcm[:4800], pcm[4800:]]))
    fmt = events[0]["session"]["audio"]
    assert fmt["input"]["format"] == fmt["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
    bad = [e for e in events if e["type"] == "error"]
    assert [e["error"]["code"] for e in bad] == ["invalid_audio"] and "PCM16 24000 Hz" in bad[0]["error"]["message"]
    n = -(-round(x.size * 16000 / 24000) // FRAME_IN)
    assert len(model.heard[4]) == n
    assert abs(len(audio_bytes(events)) - 2 * n * 1920) <= 4   # 1764 samples at 22.05 kHz = 1920 at 24 kHz
    srv.wait_idle()


def test_upload_at_any_rate_and_channel_count(server):
    """A 48 kHz stereo 24-bit-free (16-bit) WAV: averaged to mono, resampled to 16 kHz, as decode_wav does
    it in one shot."""
    srv, model = server()
    left, right = tone(1.0, freq=300.0, amp=0.3), tone(1.0, freq=500.0, amp=0.2)
    stereo = np.stack([resample(left, 16000, 48000), resample(right, 16000, 48000)], axis=1).reshape(-1)
    body = wav_bytes(stereo, rate=48000, channels=2)

    async def post():
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{srv.url}/generate?seed=9", data=body) as r:
                assert r.status == 200
                return [json.loads(line) async for line in r.content if line.strip()]

    lines = asyncio.run(post())
    want = decode_wav(body, 16000)
    got = heard(model, 9)
    assert got.size == -(-want.size // FRAME_IN) * FRAME_IN
    np.testing.assert_allclose(got[:want.size], want, atol=1e-6)
    assert lines[0]["input"]["sample_rate"] == 16000 and lines[-1] == {"type": "ended", "reason": "completed"}


# ---- events clients wait on ------------------------------------------------------------------------------
def test_speech_started_and_stopped_follow_the_user_transcript(server, tok):
    """The RNN-T's tokens start the user's speech; `serve.speech_hangover_ms` (400 ms = 5 frames) after its
    last token, speech_stopped, and the user item is committed and done with its transcript. Speech still
    going when the input ends stops there."""
    srv, model = server(speech_hangover_ms=400)
    word = tok.encode("hi")[:1]
    model.user[6] = {3: word, 4: word, 6: word, 20: word}
    async def end_after_the_last_frame(ev, ws):   # (a commit is the client's: it would close the segment early)
        if ev["type"] == "response.output_audio.delta" and ev["frame"] == 23:
            await ws.send_json({"type": "input_audio_buffer.commit", "final": True})

    events, _ = asyncio.run(realtime(srv.ws_url, tone(0.08 * 24), chunk=FRAME_IN, session={"seed": 6}, final=False,
                                     on_event=end_after_the_last_frame))
    kinds = [e["type"] for e in events]
    started = [e for e in events if e["type"] == "input_audio_buffer.speech_started"]
    stopped = [e for e in events if e["type"] == "input_audio_buffer.speech_stopped"]
    assert [e["audio_start_ms"] for e in started] == [240, 1600]
    assert [e["audio_end_ms"] for e in stopped] == [560, 1680]     # frame 6's end (frame 11 says so); frame 20's
    last = len(kinds) - 1 - kinds[::-1].index("input_audio_buffer.speech_stopped")
    assert kinds[last + 4] == "input_audio_buffer.drained"   # stopped, committed, completed, item done, drained
    i = kinds.index("input_audio_buffer.speech_stopped")
    assert kinds[i + 1: i + 4] == ["input_audio_buffer.committed",
                                   "conversation.item.input_audio_transcription.completed", "conversation.item.done"]
    done = events[i + 3]["item"]
    assert done["role"] == "user" and done["status"] == "completed" and done["id"] == stopped[0]["item_id"]
    assert started[0]["item_id"] == stopped[0]["item_id"] != started[1]["item_id"] == stopped[1]["item_id"]
    srv.wait_idle()


def test_clear_drops_the_input_not_yet_stepped(server):
    """input_audio_buffer.clear: the frames received but not stepped are dropped (the step never hears
    them), `input_audio_buffer.cleared` answers, and audio sent after it is heard."""
    srv, model = server(engine_kwargs={"max_pending_s": 5.0})
    model.step_s = 0.05
    first, second = tone(2.4, amp=0.5), tone(0.4, amp=0.25)
    sent = []

    async def on_event(ev, ws):   # after the first packet: clear the 29 frames still queued, then more audio
        if ev["type"] == "response.output_audio.delta" and not sent:
            sent.append(1)
            await ws.send_json({"type": "input_audio_buffer.clear"})
            await ws.send_json({"type": "input_audio_buffer.append", "audio": b64(second)})
            await ws.send_json({"type": "input_audio_buffer.commit", "final": True})

    events, _ = asyncio.run(realtime(srv.ws_url, first, chunk=first.size, session={"seed": 7}, final=False,
                                     on_event=on_event))
    assert "input_audio_buffer.cleared" in [e["type"] for e in events]
    peaks = [float(np.abs(f).max()) for f in model.heard[7]]
    loud = sum(p > 0.4 for p in peaks)
    assert 1 <= loud < 30                                  # some of the first 30 frames, not all
    assert sum(0.2 < p < 0.3 for p in peaks) == 5          # all of the second
    assert errors(events) == [] and events[-1]["type"] == "session.closed"
    srv.wait_idle()


@pytest.mark.parametrize("modalities", [["audio"], ["text"]])
def test_modalities_and_usage(server, tok, modalities):
    """["text"]: the agent's text as output_text events and no audio at all; response.done carries usage
    in the model's units (an input audio token per frame heard, an output audio token per frame spoken,
    an output text token per non-special text token)."""
    srv, model = server()
    t = model.cfg.tokens
    words = tok.encode("hello there")
    model.text[8] = [t.pad_id, t.bos_id] + words + [t.eos_id]
    events, _ = asyncio.run(realtime(srv.ws_url, tone(0.08 * 12), chunk=FRAME_IN,
                                     session={"seed": 8, "output_modalities": modalities}))
    kinds = [e["type"] for e in events]
    done = [e["response"] for e in events if e["type"] == "response.done"]
    assert [d["status"] for d in done] == ["completed"] * len(done) and done[0]["output_modalities"] == modalities
    # the first response: frame 0 (PAD), BOS, the words, EOS (a BOS opens a new response only after text)
    frames, usage = len(words) + 3, done[0]["usage"]
    if modalities == ["text"]:
        assert not any(k.startswith("response.output_audio") for k in kinds)
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "hello there"
        assert usage["output_token_details"] == {"audio_tokens": 0, "text_tokens": len(words)}
        assert done[0]["output"][0]["content"][0] == {"type": "output_text", "text": "hello there"}
    else:
        assert "response.output_text.delta" not in kinds
        assert usage["output_token_details"] == {"audio_tokens": frames, "text_tokens": len(words)}
        assert done[0]["output"][0]["content"][0] == {"type": "output_audio", "transcript": "hello there"}
    assert usage["input_tokens"] == usage["input_token_details"]["audio_tokens"] == frames
    assert usage["output_tokens"] == sum(usage["output_token_details"].values())
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert sum(1 for k in kinds if k == "conversation.item.done") >= 2   # the user's item and the agent's
    srv.wait_idle()


# ---- tools that finish ------------------------------------------------------------------------------------
def _tool_script(model, tok, seed):
    t = model.cfg.tokens
    call = [tok.token_to_id(t.tool_call_start)] + tok.encode(TOOLCALL) + [tok.token_to_id(t.tool_call_end)]
    model.func[seed] = [t.pad_id] + call
    return len(call)   # the call closes on frame len(call)


TOOLS = [{"type": "function", "name": "get_weather", "description": "weather", "parameters": {},
          "on_hold_message": "Let me check."}]


def test_a_tool_that_never_answers_gets_an_error_result(server, tok):
    """serve.tool_timeout_s after the call, the model is given an error result on its function channel and
    the client an error event `tool_timeout` naming the limit; the call goes on and ends normally."""
    srv, model = server(tool_timeout_s=0.3, tool_on_hold_min_frames=0)
    closes_at = _tool_script(model, tok, 10)
    events, _ = asyncio.run(realtime(srv.ws_url, tone(0.08 * (closes_at + 120)), chunk=FRAME_IN, pace=0.02,
                                     session={"seed": 10, "tools": [dict(TOOLS[0], on_hold_message=None)]}))
    timeouts = [e for e in events if e["type"] == "error" and e["error"]["code"] == "tool_timeout"]
    assert len(timeouts) == 1 and "serve.tool_timeout_s = 0.3 s" in timeouts[0]["error"]["message"]
    want = tool_response_ids(tok, json.dumps({"error": "the tool did not answer within 0.3 s"}), 1024)
    assert [tok_id for seed, _, tok_id in model.forced if seed == 10] == want
    assert events[-1]["type"] == "session.closed" and events[-1]["reason"] == "completed"
    srv.wait_idle()


def test_on_hold_message_is_spoken_while_the_tool_runs(server, tok):
    """While the tool runs and the agent is silent, the on-hold message's tokens ([BOS] message [EOS]) are
    forced onto the text channel, one per frame, so the talker voices them and the client sees them in the
    transcript; the result, answered later, is injected after them."""
    srv, model = server(tool_on_hold_min_frames=0)
    closes_at = _tool_script(model, tok, 11)
    t = model.cfg.tokens
    message = [t.bos_id] + tok.encode("Let me check.") + [t.eos_id]
    answered = []

    async def on_event(ev, ws):   # the result 25 frames after the call
        if ev["type"] == "response.output_audio.delta" and ev["frame"] == closes_at + 25 and not answered:
            answered.append(1)
            call_id = next(e["call_id"] for e in events_so_far if e["type"] == "response.function_call_arguments.done")
            await ws.send_json({"type": "conversation.item.create",
                                "item": {"type": "function_call_output", "call_id": call_id, "output": "sunny"}})

    events_so_far = []

    async def record(ev, ws):
        events_so_far.append(ev)
        await on_event(ev, ws)

    events, _ = asyncio.run(realtime(srv.ws_url, tone(0.08 * (closes_at + 60)), chunk=FRAME_IN, pace=0.03,
                                     session={"seed": 11, "tools": TOOLS}, on_event=record))
    spoken = [(k, tok_id) for seed, k, tok_id in model.forced_text if seed == 11]
    assert [tok_id for _, tok_id in spoken] == message
    ks = [k for k, _ in spoken]
    # from the first frame stepped after the call's frame was handed out (the engine may be a frame or two
    # ahead of the client's side), one token per frame
    assert closes_at + 1 <= ks[0] <= closes_at + 4 and ks == list(range(ks[0], ks[0] + len(message)))
    transcripts = [e["transcript"] for e in events if e["type"] == "response.output_audio_transcript.done"]
    assert "Let me check." in transcripts
    result = [k for seed, k, _ in model.forced if seed == 11]
    assert result and result[0] > ks[-1]
    assert errors(events) == []
    srv.wait_idle()


def test_openai_sdk_at_its_defaults_with_a_tool_round_trip(server, tok):
    """The official SDK as a user writes it: the session's default formats (PCM16 24 kHz), instructions and
    a tool; the model calls it, the SDK sends the result, the model is given it."""
    from openai import AsyncOpenAI

    srv, model = server(tool_on_hold_min_frames=0)
    closes_at = _tool_script(model, tok, 0)   # the server's default seed
    x = resample(tone(0.08 * (closes_at + 80), amp=0.3), 16000, 24000)
    pcm = (x * 32767).astype("<i2").tobytes()

    async def call():
        client = AsyncOpenAI(api_key="unused", base_url=f"{srv.url}/v1", max_retries=0)
        events = []
        async with client.realtime.connect(model="nemotron-duplex") as conn:
            await conn.session.update(session={"type": "realtime", "instructions": "Be brief.",
                                               "tools": [dict(TOOLS[0], on_hold_message=None)]})

            async def send():
                for i in range(0, len(pcm), 9600):   # 200 ms appends
                    await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + 9600]).decode())
                    await asyncio.sleep(0.05)
                await conn.send({"type": "input_audio_buffer.commit", "final": True})

            sender = asyncio.create_task(send())
            async for ev in conn:
                events.append(ev)
                if ev.type == "response.function_call_arguments.done":
                    await conn.conversation.item.create(item={"type": "function_call_output", "call_id": ev.call_id,
                                                              "output": '{"temp": 21}'})
            await sender
        await client.close()
        return events

    events = asyncio.run(asyncio.wait_for(call(), 120))
    kinds = [e.type for e in events]
    assert events[0].session.audio.input.format.rate == 24000
    assert kinds.count("response.function_call_arguments.done") == 1 and "error" not in kinds
    assert [tok_id for seed, _, tok_id in model.forced if seed == 0] == tool_response_ids(tok, '{"temp": 21}', 1024)
    assert kinds[-1] == "session.closed"
    srv.wait_idle()


# ---- the documented event table ------------------------------------------------------------------------
def event_table() -> dict[str, dict[str, str]]:
    """docs/protocol.md's '## Events' table: direction -> {event: what the server does}."""
    text = DOCS.read_text()
    section = text.split("## Events", 1)[1].split("\n## ", 1)[0]
    table: dict[str, dict[str, str]] = {"client": {}, "server": {}}
    for line in section.splitlines():
        m = re.match(r"\|\s*(client|server)\s*\|\s*`([a-z_.]+)`\s*\|\s*([a-z-]+)\s*\|", line)
        if m:
            assert m.group(2) not in table[m.group(1)], f"{m.group(2)} twice in the table"
            table[m.group(1)][m.group(2)] = m.group(3)
    return table


def test_the_documented_event_table_is_the_code():
    table = event_table()
    client = table["client"]
    assert {e for e, what in client.items() if what == "supported"} == rp.CLIENT_EVENTS
    assert {e for e, what in client.items() if what == "no-op"} == rp.NO_OP_EVENTS
    assert {e for e, what in client.items() if what == "refused"} == rp.NOT_SUPPORTED_EVENTS
    aliases = {e for e, what in client.items() if what == "alias"}
    assert aliases == {k for k, v in rp.CLIENT_ALIASES.items() if k != v}
    assert set(client.values()) == {"supported", "no-op", "refused", "alias"}
    assert set(table["server"]) == rp.SERVER_EVENTS and set(table["server"].values()) == {"sent"}


def test_openai_agents_sdk_voice_agent_with_a_tool(server, tok):
    """A second maintained Realtime client, OpenAI's Agents SDK (openai-agents on PyPI): a RealtimeAgent with a
    function tool, at the SDK's default session (its stock voice "ash", PCM16 24 kHz, server VAD settings).
    The SDK runs the tool the model calls and sends its output; the model is given it; the SDK reports no
    error at all (it validates every server event against OpenAI's schema: a missing field or an event of
    ours it does not know would be one). It hangs up the standard way, by closing the session."""
    from agents import function_tool
    from agents.realtime import RealtimeAgent, RealtimeRunner

    srv, model = server(tool_on_hold_min_frames=0)
    closes_at = _tool_script(model, tok, 0)
    want = tool_response_ids(tok, '{"temp": 21}', 1024)
    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return '{"temp": 21}'

    agent = RealtimeAgent(name="assistant", instructions="Be brief.", tools=[get_weather])
    x = resample(tone(0.08 * (closes_at + 80), amp=0.3), 16000, 24000)
    pcm = (x * 32767).astype("<i2").tobytes()

    async def run():
        session = await RealtimeRunner(agent).run(model_config={"url": f"{srv.ws_url}/v1/realtime",
                                                                 "api_key": "unused"})
        seen, raw = [], []
        async with session:
            async def send():
                for i in range(0, len(pcm), 9600):   # 200 ms appends, paced
                    await session.send_audio(pcm[i:i + 9600])
                    await asyncio.sleep(0.05)
                while len([f for f in model.forced if f[0] == 0]) < len(want):   # the result is in the model
                    await asyncio.sleep(0.05)
                await session.close()

            sender = asyncio.create_task(send())
            async for ev in session:
                seen.append(ev)
                if ev.type == "raw_model_event" and ev.data.type == "raw_server_event":
                    raw.append(ev.data.data)
            await sender
        return seen, raw

    seen, raw = asyncio.run(asyncio.wait_for(run(), 120))
    kinds = [e.type for e in seen]
    assert "error" not in kinds, [e for e in seen if e.type == "error"][:1]
    assert cities == ["Paris"] and kinds.count("tool_end") == 1 and kinds.count("audio") > closes_at
    assert [tok_id for seed, _, tok_id in model.forced if seed == 0] == want
    updated = [r for r in raw if r["type"] == "session.updated"][-1]["session"]
    assert updated["audio"]["output"]["voice"] == model.cfg.talker.speaker    # "ash" -> the checkpoint's voice
    assert updated["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert "Be brief." in tok.decode(model.prompts[-1][1:-1])                  # its instructions are the prompt
    srv.wait_idle()
