"""The browser page in headless Chromium with a fake microphone fed from a WAV file: the page's audio
reaches the engine, and agent audio comes back (read from the page's own `window.duplexState`).
Chromium is driven over the DevTools protocol with aiohttp (no playwright). Needs the `chromium`
package (Debian: `apt-get install -y chromium`)."""
from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest

from tests.server_support import make, tone, wav_bytes

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")


class Chromium:
    """A headless Chromium with a fake microphone, and a minimal DevTools client."""

    def __init__(self, mic_wav: Path):
        self.profile = tempfile.mkdtemp(prefix="chromium-")
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={self.profile}", "--remote-debugging-port=0", "--remote-allow-origins=*",
             "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
             f"--use-file-for-fake-audio-capture={mic_wav}", "--autoplay-policy=no-user-gesture-required",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"
        t0 = time.monotonic()
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() - t0 > 30 or self.proc.poll() is not None:
                raise RuntimeError("chromium did not start its DevTools endpoint")
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])
        self._ids = itertools.count(1)

    async def page(self, http: aiohttp.ClientSession):
        async with http.get(f"http://127.0.0.1:{self.port}/json/list") as r:
            targets = await r.json()
        page = next(t for t in targets if t["type"] == "page")
        return await http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)

    async def send(self, ws, method: str, **params):
        i = next(self._ids)
        await ws.send_json({"id": i, "method": method, "params": params})
        async for m in ws:
            msg = json.loads(m.data)
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
        raise RuntimeError("DevTools socket closed")

    async def evaluate(self, ws, expression: str):
        res = await self.send(ws, "Runtime.evaluate", expression=expression, returnByValue=True)
        return res.get("result", {}).get("value")

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)


def browse(srv, browser: Chromium, url: str, during=None) -> dict | None:
    """Open `url` of the page, poll `window.duplexState` until the call closed (60 s at most); `during(state)`
    runs at each poll. -> the last state."""
    async def go():
        async with aiohttp.ClientSession() as http:
            ws = await browser.page(http)
            await browser.send(ws, "Runtime.enable")
            await browser.send(ws, "Page.navigate", url=url)
            state, t0 = None, time.monotonic()
            while time.monotonic() - t0 < 60:
                raw = await browser.evaluate(ws, "JSON.stringify(window.duplexState || null)")
                state = json.loads(raw) if raw else None
                if state and state["closed"]:
                    break
                if state and during is not None:
                    during(state)
                await asyncio.sleep(0.2)
            await ws.close()
            return state

    return asyncio.run(go())


def speaking_model(monkeypatch, tok):
    """The scripted server; its model says a sentence and records each frame's input peak."""
    srv, model = make(monkeypatch, tok)
    model.text[0] = [model.cfg.tokens.bos_id] + tok.encode("hello from the model") + [model.cfg.tokens.eos_id]
    peaks = []
    step = model.step

    def recording_step(slots, audio, forced):   # what reached the engine, per frame
        peaks.extend(float(a.abs().max()) for a in audio)
        return step(slots, audio, forced)

    model.step = recording_step
    return srv, peaks


def test_browser_call_with_fake_microphone(monkeypatch, tmp_path):
    from tests.server_support import tiny_tokenizer

    srv, peaks = speaking_model(monkeypatch, tiny_tokenizer())
    mic = tmp_path / "mic.wav"
    mic.write_bytes(wav_bytes(tone(3.0, amp=0.5)))
    browser = Chromium(mic)
    try:
        state = browse(srv, browser, f"{srv.url}/?autostart=1&seconds=2")
    finally:
        browser.close()
        srv.close()
    assert state is not None and state["closed"], state
    assert not state["errors"], state["errors"]
    assert state["closeCode"] == 1000
    assert state["micPeak"] > 0.1                             # the fake microphone played into the page
    assert 20 <= state["framesSent"] <= 30                    # ~2 s of 80 ms frames
    assert state["drained"] == state["framesSent"] == state["packetsReceived"]
    assert state["samplesReceived"] == 1764 * state["packetsReceived"]
    assert state["agentText"].strip() == "hello from the model"
    assert len(peaks) == state["framesSent"] and max(peaks) > 0.1   # and reached the engine
    assert state["resumes"] == 0


def test_the_page_resumes_its_call_after_the_connection_drops(monkeypatch, tmp_path):
    """The server resets the page's connection mid-sentence (a network dropout as the page sees it: close 1006):
    the page reconnects with the call's token, and gets the rest of the call, every frame the engine stepped
    once, the sentence whole, and a normal end."""
    from tests.server_support import tiny_tokenizer

    srv, peaks = speaking_model(monkeypatch, tiny_tokenizer())
    mic = tmp_path / "mic.wav"
    mic.write_bytes(wav_bytes(tone(4.0, amp=0.5)))
    dropped = []

    def drop_at_packet_3(state):
        if state["packetsReceived"] >= 3 and not dropped:
            srv.reset_connection("/v1/realtime")
            dropped.append(state["packetsReceived"])

    browser = Chromium(mic)
    try:
        state = browse(srv, browser, f"{srv.url}/?autostart=1&seconds=3", during=drop_at_packet_3)
    finally:
        browser.close()
        srv.close()
    assert dropped and state is not None and state["closed"], state
    assert not state["errors"], state["errors"]
    assert state["resumes"] == 1 and state["closeCode"] == 1000
    assert state["drained"] == state["packetsReceived"] == len(peaks)      # each frame stepped came back once
    assert state["framesSent"] >= state["drained"] >= 20                    # (a dropout loses what it sends)
    assert state["samplesReceived"] == 1764 * state["packetsReceived"]
    assert state["agentText"].strip() == "hello from the model"            # the sentence spans the dropout
    assert srv.server.metrics.resumes.labels("resumed")._value.get() == 1
