"""The server on the embedded tiny model (CPU): the official OpenAI SDK runs a call; 16 paced calls and
uploads at once all complete with every packet in order; what the server sends equals the plain
streaming loop (spec 7.2) for the same clip and seed."""
from __future__ import annotations

import asyncio
import base64
import json
import struct

import aiohttp
import numpy as np
import pytest
import torch

from nemo_duplex.audio import read_wav, resample
from nemo_duplex.server.app import Server
from nemo_duplex.serving.engine import build_engine
from nemo_duplex.settings import EngineConfig, ServeConfig
from tests.server_support import RunningServer, wav_bytes

FRAME_IN = 1280


@pytest.fixture(scope="module")
def tiny():
    from nemo_duplex import runtime
    from tests.apps import compose_app

    # One intra-op thread: the engine thread and the test clients share 2 cores, and torch's spinning
    # OpenMP workers make a loaded 2-core box ~15x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # The model's kernels run their torch references here: these tests are about the server, and the
    # Triton interpreter (conftest sets it for the kernel tests) would make each frame take seconds.
    patch = pytest.MonkeyPatch()
    patch.delenv("TRITON_INTERPRET", raising=False)
    model, tokenizer, rnnt_vocab, mcfg = runtime.load(compose_app("serve"), overrides=[])
    clip = read_wav(runtime.REPO / "eval" / "clips" / "example.wav", mcfg.source_sample_rate)
    yield model, tokenizer, rnnt_vocab, clip
    torch.set_num_threads(threads)
    patch.undo()


def serve(tiny, max_calls: int, pipeline: int = 0, **kw) -> RunningServer:
    model, tokenizer, rnnt_vocab, _ = tiny
    cfg = ServeConfig(warmup_frames=1, **kw)
    engine = build_engine(model, tokenizer, EngineConfig(max_calls=max_calls, max_call_s=20.0, pipeline=pipeline))
    return RunningServer(Server(engine, tokenizer, rnnt_vocab, cfg))


def test_openai_sdk_call_at_its_defaults(tiny):
    """The official SDK as a user writes it: no audio format in the session, so PCM16 at 24 kHz both ways.
    Every frame's audio comes back at 24 kHz (1920 samples a frame, the resampler's tail after the last),
    with the agent's transcript, the user's items and usage."""
    from openai import AsyncOpenAI

    audio = resample(tiny[3][: int(1.5 * 16000)], 16000, 24000)
    srv = serve(tiny, max_calls=2)
    try:
        async def call():
            client = AsyncOpenAI(api_key="unused", base_url=f"{srv.url}/v1", max_retries=0)
            events = []
            async with client.realtime.connect(model="nemotron-duplex") as conn:
                await conn.session.update(session={"type": "realtime", "instructions": "You are a helpful assistant."})
                pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
                for i in range(0, len(pcm), 4800):   # 100 ms appends: not frame-aligned on purpose
                    await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + 4800]).decode())
                await conn.send({"type": "input_audio_buffer.commit", "final": True})
                async for ev in conn:
                    events.append(ev)
            await client.close()
            return events

        events = asyncio.run(asyncio.wait_for(call(), 120))
    finally:
        srv.close()
    kinds = [e.type for e in events]
    assert kinds[0] == "session.created" and "session.updated" in kinds
    assert events[0].session.audio.input.format.rate == events[0].session.audio.output.format.rate == 24000
    audio_deltas = [e for e in events if e.type == "response.output_audio.delta"]
    n = -(-round(audio.size * 16000 / 24000) // FRAME_IN)
    assert [e.frame for e in audio_deltas] == list(range(n)) + [n - 1]     # extension field; the tail last
    assert abs(sum(len(base64.b64decode(e.delta)) for e in audio_deltas) - 2 * 1920 * n) <= 4
    text = [e for e in events if e.type == "response.output_audio_transcript.delta"]
    assert text and all(e.delta for e in text)
    assert kinds[-1] == "session.closed" and "error" not in kinds
    assert "input_audio_buffer.drained" in kinds and "input_audio_buffer.committed" in kinds
    assert all(e.response.usage.input_tokens > 0 for e in events if e.type == "response.done")


def test_a_24khz_call_gives_the_tokens_of_the_16khz_call(tiny):
    """The same audio sent at 16 kHz and as its 24 kHz resampling (soxr, one shot) gives the same text,
    function tokens on every frame (the user tokens on all but near-tied frames): the streaming 24 -> 16 kHz conversion returns the signal within
    the round trip's error (asserted below: RMS under 1% of the clip's, -40 dB; the peak error is the band
    edge's 0.005 of full scale), which moves no token of this clip. Native protocol with `tokens: true`."""
    clip = tiny[3][: int(2.0 * 16000)]
    at24 = resample(clip, 16000, 24000)
    error = (resample(at24, 24000, 16000) - clip)[200:-200]
    assert np.sqrt(np.mean(error ** 2)) < 0.01 * np.sqrt(np.mean(clip ** 2))
    srv = serve(tiny, max_calls=2)
    try:
        async def call(x, rate):
            pcm = (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()
            tokens = []
            async with aiohttp.ClientSession() as http:
                async with http.ws_connect(f"{srv.ws_url}/generate/ws") as ws:
                    await ws.send_json({"type": "start", "seed": 1, "sample_rate": rate, "tokens": True})
                    step = rate // 10 * 2
                    for i in range(0, len(pcm), step):
                        await ws.send_bytes(pcm[i:i + step])
                    await ws.send_json({"type": "end_input"})
                    async for m in ws:
                        if m.type == aiohttp.WSMsgType.TEXT and json.loads(m.data)["type"] == "tokens":
                            ev = json.loads(m.data)
                            tokens.append((ev["text"], ev["func"], tuple(ev["user"])))
            return tokens

        a16, a24 = asyncio.run(call(clip, 16000)), asyncio.run(call(at24, 24000))
    finally:
        srv.close()
    assert len(a16) == len(a24) == -(-clip.size // FRAME_IN)
    assert [a[:2] for a in a16] == [a[:2] for a in a24]            # the text and function channels
    # the user transcript: the tiny RNN-T's random joint emits its 10 symbols a frame between two near-tied ids
    # (2 and 15), so the resampler's error may reorder them on a frame or two (one of 25 here); not more
    assert sum(a[2] != b[2] for a, b in zip(a16, a24)) <= 2


@pytest.mark.parametrize("pipeline", [0, 2])
def test_sixteen_paced_calls_and_uploads(tiny, pipeline):
    """Also two deep (engine.pipeline=2): every frame of every call arrives, in order, and every call ends
    completed, with frames in flight drained at each call's end."""
    clip = tiny[3]
    n_live, n_up = 16, 2
    srv = serve(tiny, max_calls=n_live + n_up, pipeline=pipeline)
    lens = [int((0.8 + 0.04 * i) * 16000) for i in range(n_live + n_up)]

    async def live(i):
        x = clip[1000 * i: 1000 * i + lens[i]]
        pcm = (x * 32767).astype("<i2").tobytes()
        events = []
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(f"{srv.ws_url}/v1/realtime") as ws:
                await ws.send_json({"type": "session.update", "session": {   # the model's own rates both ways
                    "seed": i, "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}},
                                         "output": {"format": {"type": "audio/pcm", "rate": 22050}}}}})

                async def send():
                    for k in range(0, len(pcm), 2 * FRAME_IN):   # paced: one 80 ms append every 80 ms
                        await ws.send_json({"type": "input_audio_buffer.append",
                                            "audio": base64.b64encode(pcm[k:k + 2 * FRAME_IN]).decode()})
                        await asyncio.sleep(0.08)
                    await ws.send_json({"type": "input_audio_buffer.commit", "final": True})

                sender = asyncio.create_task(send())
                async for m in ws:
                    events.append(json.loads(m.data))
                await sender
        return events

    async def upload(i):
        x = clip[1000 * i: 1000 * i + lens[i]]
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{srv.url}/generate?seed={i}", data=wav_bytes(x)) as r:
                assert r.status == 200
                return [json.loads(line) async for line in r.content if line.strip()]

    async def everyone():
        return await asyncio.gather(*[live(i) for i in range(n_live)],
                                    *[upload(i) for i in range(n_live, n_live + n_up)])

    try:
        results = asyncio.run(asyncio.wait_for(everyone(), 300))
        srv.wait_idle()
    finally:
        srv.close()
    for i, events in enumerate(results[:n_live]):
        frames = [e["frame"] for e in events if e["type"] == "response.output_audio.delta"]
        assert frames == list(range(-(-lens[i] // FRAME_IN))), f"call {i}"
        assert not [e for e in events if e["type"] == "error"], f"call {i}"
        assert events[-1]["type"] == "session.closed", f"call {i}"
    for j, lines in enumerate(results[n_live:]):
        i = n_live + j
        assert [x["frame"] for x in lines if x["type"] == "audio"] == list(range(-(-lens[i] // FRAME_IN)))
        assert lines[-1] == {"type": "ended", "reason": "completed"}


@pytest.mark.parametrize("pipeline", [0, 1, 2])
def test_served_frames_equal_streaming_loop(tiny, pipeline):
    """Native WS with {"tokens": true}: the served text/function tokens equal stream_inference's for the
    same clip and seed (greedy), and the served PCM16 equals its waveform to within 1 LSB of rounding; also
    with engine.pipeline (each frame's event one or two steps later, the last ones after end_input)."""
    from nemo_duplex.serving.frame_step import stream_inference

    model, tokenizer, _, clip = tiny
    x = clip[: int(1.2 * 16000)]
    ref = stream_inference(model, torch.from_numpy(x), None, seed=4)
    srv = serve(tiny, max_calls=1, pipeline=pipeline)
    try:
        async def go():
            async with aiohttp.ClientSession() as http:
                async with http.ws_connect(f"{srv.ws_url}/generate/ws") as ws:
                    await ws.send_json({"type": "start", "seed": 4, "tokens": True})
                    await ws.send_bytes((np.clip(x, -1, 1) * 32768).clip(-32768, 32767).astype("<i2").tobytes())
                    await ws.send_json({"type": "end_input"})
                    packets, events = [], []
                    async for m in ws:
                        (packets if m.type == aiohttp.WSMsgType.BINARY else events).append(
                            m.data if m.type == aiohttp.WSMsgType.BINARY else json.loads(m.data))
                    return packets, events

        packets, events = asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        srv.close()
    toks = [e for e in events if e["type"] == "tokens"]
    assert [e["frame"] for e in toks] == list(range(len(ref.text_tokens)))
    assert [e["text"] for e in toks] == ref.text_tokens.tolist()
    assert [e["func"] for e in toks] == ref.function_tokens.tolist()
    assert [struct.unpack_from("<If", p)[0] for p in packets] == list(range(len(ref.text_tokens)))
    served = np.concatenate([np.frombuffer(p[8:], "<i2") for p in packets]).astype(np.int32)
    want = np.clip(np.round(ref.wav.numpy() * 32767), -32768, 32767).astype(np.int32)
    assert served.shape == want.shape
    assert np.abs(served - want).max() <= 1     # tolerance: one LSB (float rounding of the same samples)
