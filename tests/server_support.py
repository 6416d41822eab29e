"""Helpers for the server tests: a real `Engine` whose frame step is scripted (so tool calls, turns and
ordering can be asserted exactly), the embedded tiny model, a server running on loopback in its own
thread with its own event loop, exactly as `scripts/serve.py` runs it, and a Realtime client."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time
import wave
from dataclasses import dataclass, field
from types import SimpleNamespace

import aiohttp
import numpy as np
import torch

from graphs.capture import HostStepper
from nemo_duplex.models.config import tiny_config
from nemo_duplex.models.tokenizer import Tokenizer, make_tiny_rnnt_vocab, make_tiny_tokenizer
from nemo_duplex.server.app import Server
from nemo_duplex.serving import engine as engine_mod
from nemo_duplex.serving.engine import Engine
from nemo_duplex.serving.frame_step import StepOutput
from nemo_duplex.serving.runner import HOST_FIELDS
from nemo_duplex.settings import EngineConfig, ServeConfig


# ---- a scripted model --------------------------------------------------------------------------------
@dataclass
class SlotScript:
    frame: int = 0
    seed: int = 0
    prompt: list[int] | None = None
    speaker: str | None = None


@dataclass
class ScriptedModel:
    """Stands in for VoiceChat inside the real Engine. Per call (keyed by seed): `text[seed]` and
    `func[seed]` are token lists, one per frame (PAD after the end). Output PCM sample 0 holds the frame
    index and sample 1 the seed (as int16), so a client can check order and ownership of every packet."""
    cfg: object = field(default_factory=tiny_config)
    text: dict = field(default_factory=dict)
    func: dict = field(default_factory=dict)
    user: dict = field(default_factory=dict)   # seed -> {frame: [rnnt ids]}
    step_s: float = 0.0
    slots: dict = field(default_factory=dict)
    forced: list = field(default_factory=list)   # (seed, frame, token) of every forced function token
    forced_text: list = field(default_factory=list)   # (seed, frame, token) of every forced text token
    prompts: list = field(default_factory=list)
    heard: dict = field(default_factory=dict)   # seed -> the 1280-sample frames the step heard, in order

    def __post_init__(self):
        self.stt_model = SimpleNamespace(embed_tokens=SimpleNamespace(weight=torch.zeros(1)))

    def prompt_ids(self, tokenizer, prompt):
        if not prompt:
            return None
        t = self.cfg.tokens
        return torch.tensor([t.bos_id] + tokenizer.encode(prompt) + [t.eos_id])

    # engine hooks
    def allocate(self, model, max_calls, max_frames, device, max_prompt_tokens=0, kv_pages=None):
        # as CallState: the padding rows' slot, and unpaged KV pools (the engine keeps no pages for a script)
        return SimpleNamespace(sink=max_calls, llm=SimpleNamespace(pages=None))

    def admit(self, model, st, slot, prompt_ids, seed, sampling, speaker=None, prefix_cache=None):
        if speaker not in (None, self.cfg.talker.speaker):
            raise KeyError(f"unknown speaker {speaker!r}")
        self.slots[slot] = SlotScript(0, seed, None if prompt_ids is None else prompt_ids.tolist(), speaker)
        self.prompts.append(None if prompt_ids is None else prompt_ids.tolist())

    def step(self, slots, audio, forced):
        if self.step_s:
            time.sleep(self.step_s)
        pad = self.cfg.tokens.pad_id
        B = slots.shape[0]
        text = torch.full((B,), pad, dtype=torch.int64)
        func = torch.full((B,), pad, dtype=torch.int64)
        pcm = torch.zeros(B, self.cfg.samples_per_frame_out)
        user = torch.full((B, 2), -1, dtype=torch.int64)
        for i, s in enumerate(slots.tolist()):
            sc = self.slots[s]
            k = sc.frame
            script_t, script_f = self.text.get(sc.seed, []), self.func.get(sc.seed, [])
            text[i] = script_t[k] if k < len(script_t) else pad
            func[i] = script_f[k] if k < len(script_f) else pad
            if forced[i] >= 0:   # as frame_step: the tool result overrides the head, text is PAD (spec 3.9)
                func[i], text[i] = forced[i], pad
                self.forced.append((sc.seed, k, int(forced[i])))
            elif forced[i] <= -2:   # as frame_step: a forced text token (an on-hold message)
                text[i] = -2 - forced[i]
                self.forced_text.append((sc.seed, k, int(text[i])))
            u = self.user.get(sc.seed, {}).get(k, [])
            user[i, :len(u)] = torch.tensor(u, dtype=torch.int64)
            pcm[i, 0] = k / 32767.0
            pcm[i, 1] = sc.seed / 32767.0
            pcm[i, 2] = float(audio[i].abs().max())   # the input reached the step
            self.heard.setdefault(sc.seed, []).append(audio[i].numpy().copy())
            sc.frame += 1
        Q = self.cfg.talker.num_quantizers
        return StepOutput(text=text, func=func, top2=torch.zeros(B, 2), codes=torch.zeros(B, Q, dtype=torch.int64),
                          pcm=pcm, user=user, enc=torch.zeros(B, 1))


def scripted_engine(monkeypatch, model: ScriptedModel, tokenizer, max_calls: int = 4, **engine_kwargs) -> Engine:
    """A real Engine over the script: its admission is the script's, its runner ScriptedRunner."""
    def admission(model_, st, slot, prompt_ids, seed, sampling, speaker=None, prefix_cache=None, chunk_tokens=0,
                  graphs=None):
        model.admit(model_, st, slot, prompt_ids, seed, sampling, speaker, prefix_cache)
        yield   # one piece, as a short prompt's admission is

    monkeypatch.setattr(engine_mod, "admission", admission)
    state = model.allocate(model, max_calls, 0, torch.device("cpu"))
    return Engine(model, tokenizer, EngineConfig(max_calls=max_calls, **engine_kwargs), state, ScriptedRunner(model))


class ScriptedRunner(HostStepper):
    """Stands in for the engine's StepRunner: nothing to capture, the step is the script."""
    host_fields = HOST_FIELDS
    takes_sampling_flag = False

    def __init__(self, model):
        self.model = model

    def capture(self) -> None:   # (engine.start calls this before serving)
        time.sleep(getattr(self.model, "capture_s", 0.0))

    def __call__(self, slots, audio, forced):
        return self.model.step(slots, audio, forced)


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer(make_tiny_tokenizer())


def tiny_rnnt():
    return make_tiny_rnnt_vocab(tiny_config().rnnt.vocab_size)


# ---- a server on loopback ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """`Server(...)` served by uvicorn on 127.0.0.1 (as scripts/serve.py serves it: server.app.uvicorn_server)
    from a background thread with its own event loop."""

    def __init__(self, server: Server, wait_ready: bool = True):
        from nemo_duplex.server.app import uvicorn_server

        self.server = server
        self.port = free_port()
        self.uvicorn = uvicorn_server(server, host="127.0.0.1", port=self.port)
        self.uvicorn.config.setup_event_loop = lambda: None   # this thread's own loop (below)
        self.loop = asyncio.new_event_loop()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.uvicorn.serve())

        self.thread = threading.Thread(target=run, name="test-server", daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.uvicorn.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > 120:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        while wait_ready and not server.healthy():   # warm-up runs in the background; /health turns 200 when done
            if time.monotonic() - t0 > 120:
                raise TimeoutError("the server did not become ready")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(60)

    def reset_connection(self, path: str) -> None:
        """Reset the server's side of the one open connection on `path` (a TCP reset, no close frame): a network
        dropout, as the client sees it."""
        (conn,) = [c for c in self.uvicorn.server_state.connections
                   if (getattr(c, "scope", None) or {}).get("path") == path]
        self.loop.call_soon_threadsafe(conn.transport.abort)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Every place and engine slot given back (asserts, with the counts, on timeout)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not self.server.sessions and self.server.engine.active_calls == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"slots not returned: sessions={list(self.server.sessions)}, "
                             f"engine active={self.server.engine.active_calls}")


def wav_bytes(x: np.ndarray, rate: int = 16000, channels: int = 1, width: int = 2) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        pcm = np.clip(np.round(x * 32767), -32768, 32767).astype("<i2")
        if width == 1:
            w.writeframes((pcm // 256 + 128).astype(np.uint8).tobytes())
        else:
            w.writeframes(np.repeat(pcm, channels).tobytes() if channels > 1 else pcm.tobytes())
    return buf.getvalue()


def tone(seconds: float, rate: int = 16000, freq: float = 220.0, amp: float = 0.3, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    return (amp * np.sin(2 * np.pi * freq * t) + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


def make(monkeypatch, tok, model=None, engine_kwargs=None, wait_ready=True, **serve):
    model = model or ScriptedModel()
    limits = {k: serve.pop(k) for k in ("max_calls", "max_call_s", "max_pending_s") if k in serve}   # the engine's
    cfg = ServeConfig(**{"warmup_frames": 1, **serve})
    eng = scripted_engine(monkeypatch, model, tok, **{"max_calls": 4, **limits, **(engine_kwargs or {})})
    srv = RunningServer(Server(eng, tok, tiny_rnnt(), cfg), wait_ready=wait_ready)
    return srv, model


# ---- a Realtime client ---------------------------------------------------------------------------------
def b64(x: np.ndarray) -> str:
    return base64.b64encode(np.clip(np.round(x * 32767), -32768, 32767).astype("<i2").tobytes()).decode()


def frames_of(events) -> list[np.ndarray]:
    return [np.frombuffer(base64.b64decode(e["delta"]), "<i2") for e in events
            if e["type"] == "response.output_audio.delta"]


# the model's own rates both ways, so the scripted model's markers in each packet come through unresampled
NATIVE = {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}},
                    "output": {"format": {"type": "audio/pcm", "rate": 22050}}}}


async def realtime(url, audio=None, chunk=1000, pace=0.0, session=None, final=True, extra=(), query="",
                   on_event=None, native=True):
    """One Realtime call: a session.update (with the model's own audio formats unless `native` is False, then
    `session`'s settings), appends of `chunk` samples, commit{final}; returns (events, close code).
    `on_event(ev, ws)` may send more (runs on every event)."""
    events = []
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(f"{url}/v1/realtime{query}") as ws:
            for update in ([NATIVE] if native else []) + ([session] if session is not None else []):
                await ws.send_json({"type": "session.update", "session": update})
            for e in extra:
                await (ws.send_str(e) if isinstance(e, str) else ws.send_json(e))

            async def send():
                try:
                    await send_all()
                except ConnectionError:   # the server ended the call (a limit): stop sending
                    pass

            async def send_all():
                if audio is not None:
                    for i in range(0, audio.size, chunk):
                        await ws.send_json({"type": "input_audio_buffer.append", "audio": b64(audio[i:i + chunk])})
                        if pace:
                            await asyncio.sleep(pace)
                if final:
                    await ws.send_json({"type": "input_audio_buffer.commit", "final": True})

            sender = asyncio.create_task(send())
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    ev = json.loads(msg.data)
                    events.append(ev)
                    if on_event is not None:
                        await on_event(ev, ws)
            await sender
            return events, ws.close_code


def assert_recovers(srv: RunningServer) -> None:
    """After a barrage of clients: every place and engine slot given back (the last calls may still be
    closing), the server healthy with its engine up, and the next Realtime call served in full (0.4 s of
    input: 5 frames)."""
    srv.wait_idle(timeout=30.0)
    assert srv.server.healthy() and srv.server.engine.down is None
    events, code = asyncio.run(realtime(srv.ws_url, tone(0.4), chunk=1280))
    assert code == 1000 and len(frames_of(events)) == 5
