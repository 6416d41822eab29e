"""Random client input against the real server (scripted frame step, tests/server_support.py): Realtime
and native sockets sending events with fields of every wrong type, garbage frames, oversized messages,
audio of odd sizes and rates, closes at random times; uploads with broken bodies. Whatever arrives, the
server logs no error (aiohttp logs an exception that escapes a handler as "Error handling request"),
stays healthy, gives every place and engine slot back, and serves the next call. The first run found
that a multipart upload without a boundary raised into the handler (now a 400 `invalid_upload`)."""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import random

import aiohttp
import numpy as np
import pytest

from tests.server_support import assert_recovers, make, tone, wav_bytes

TYPES = ["input_audio_buffer.append", "session.update", "input_audio_buffer.commit", "conversation.item.create",
         "response.cancel", "session.close", "session.ping", "response.create", "input_audio_buffer.clear",
         "bogus", "start", "end_input", "tool_output", "abort", None, 5]


class Fuzz:
    def __init__(self, seed: int):
        self.r = random.Random(seed)

    def junk(self):
        return self.r.choice([None, 1, -1, 1e308, "x", "", [], {}, [1, {"a": None}], True, "A" * 5000,
                              {"type": 3}, 0.5])

    def event(self) -> dict:
        r, t = self.r, self.r.choice(TYPES)
        ev: dict = {"type": t}
        if t == "input_audio_buffer.append":
            n = r.choice([0, 1, 2, 1279, 1280, 2560, 16000])
            ev["audio"] = r.choice([base64.b64encode(np.zeros(n, "<i2").tobytes()).decode(), "!!!", self.junk(),
                                    base64.b64encode(b"\x00" * 3).decode()])
            if r.random() < 0.2:
                ev["sample_rate"] = r.choice([8000, 16000, "16k"])
        elif t == "session.update":
            ev["session"] = r.choice([self.junk(), {k: self.junk() for k in (
                "instructions", "tools", "voice", "temperature", "input_audio_format", "turn_detection", "top_p")}])
        elif t == "input_audio_buffer.commit":
            ev["final"] = r.choice([True, False, self.junk()])
        elif t == "conversation.item.create":
            ev["item"] = r.choice([self.junk(), {"type": "function_call_output", "call_id": self.junk(),
                                                 "output": self.junk()}])
        elif t == "tool_output":
            ev["call_id"], ev["output"] = self.junk(), self.junk()
        for _ in range(r.randint(0, 2)):
            ev[r.choice(["event_id", "x", "session", "item"])] = self.junk()
        return ev

    async def realtime_client(self, http, url: str) -> None:
        r = self.r
        async with http.ws_connect(f"{url}/v1/realtime", max_msg_size=0) as ws:
            reader = asyncio.create_task(_drain(ws))
            for _ in range(r.randint(1, 30)):
                x = r.random()
                if x < 0.05:
                    await ws.send_bytes(bytes(r.randrange(256) for _ in range(r.randint(0, 100))))
                elif x < 0.1:
                    await ws.send_str(r.choice(["{", "[]", "null", '"x"', '{"type":', "x" * 70000]))
                else:
                    await ws.send_str(json.dumps(self.event()))
                await asyncio.sleep(r.random() * 0.02)
            if r.random() < 0.5:
                await ws.close()
            else:
                await asyncio.sleep(r.random() * 0.5)
            reader.cancel()

    async def native_client(self, http, url: str, i: int) -> None:
        r = self.r
        async with http.ws_connect(f"{url}/generate/ws", max_msg_size=0) as ws:
            reader = asyncio.create_task(_drain(ws))
            first = r.choice([{"type": "start", "seed": self.junk(), "call_id": r.choice([None, "dup", f"c{i}", self.junk()]),
                               "sample_rate": r.choice([16000, 8000, self.junk()]), "temperature": self.junk(),
                               "prompt": self.junk()}, self.junk(), "not json"])
            await ws.send_str(first if isinstance(first, str) else json.dumps(first))
            for _ in range(r.randint(0, 20)):
                if r.random() < 0.5:
                    pcm = np.zeros(r.choice([0, 1, 1280, 1281, 20000]), "<i2").tobytes()
                    await ws.send_bytes(pcm[:r.choice([None, 3])])
                else:
                    await ws.send_str(json.dumps(self.event()))
                await asyncio.sleep(r.random() * 0.02)
            reader.cancel()

    async def upload_client(self, http, url: str) -> None:
        r = self.r
        body = r.choice([b"", b"RIFF", b"\x00" * 100, wav_bytes(tone(0.3))[:r.randint(0, 12000)], b"--x\r\n"])
        ctype = r.choice(["audio/wav", "multipart/form-data", "multipart/form-data; boundary=x", "text/plain"])
        async with http.post(f"{url}/generate?seed={r.choice(['1', 'x', ''])}", data=body,
                             headers={"Content-Type": ctype}) as resp:
            await resp.read()


async def _drain(ws) -> None:
    async for _ in ws:
        pass


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_client_input_never_breaks_the_server(monkeypatch, tok, caplog, seed):  # noqa: F811
    srv, _ = make(monkeypatch, tok, max_calls=4, max_call_s=5.0, idle_timeout_s=2.0, max_message_kb=64,
                  max_upload_mb=1, max_pending_s=2.0)
    fuzz = Fuzz(seed)

    async def clients():
        async with aiohttp.ClientSession() as http:
            for _ in range(8):
                runs = []
                for i in range(8):
                    kind = fuzz.r.choice(["realtime", "realtime", "native", "upload"])
                    runs.append(fuzz.realtime_client(http, srv.ws_url) if kind == "realtime" else
                                fuzz.native_client(http, srv.ws_url, i) if kind == "native" else
                                fuzz.upload_client(http, srv.url))
                results = await asyncio.gather(*(asyncio.wait_for(c, 30) for c in runs), return_exceptions=True)
                # a client may see its connection closed or refused; none may hang
                assert not any(isinstance(x, asyncio.TimeoutError) for x in results)

    try:
        with caplog.at_level(logging.ERROR):
            asyncio.run(clients())
            assert_recovers(srv)
        assert [f"{r.getMessage()}: {r.exc_info[1]!r}" if r.exc_info else r.getMessage()
                for r in caplog.records if r.levelno >= logging.ERROR] == []
    finally:
        srv.close()
