"""Who may call (nemo_duplex/server/access.py): API keys as a Bearer header or the browser's subprotocol, on
every call route and /metrics; origins other than the server's own refused unless allowed; CORS only when
configured; /health and the page stay open."""
from __future__ import annotations

import asyncio
import base64
import json

import aiohttp
import pytest
from starlette.datastructures import Headers

from nemo_duplex.server.access import Access
from nemo_duplex.settings import ServeConfig
from tests.server_support import tone, wav_bytes

KEY = "sk-test-0123456789"


async def ws_status(url: str, **kw) -> tuple[int, str | None]:
    """(101 and the accepted subprotocol) or (the refusal's HTTP status, its code)."""
    async with aiohttp.ClientSession() as http:
        try:
            async with http.ws_connect(url, **kw) as ws:
                return 101, ws.protocol
        except aiohttp.WSServerHandshakeError as e:
            return e.status, None


async def http_status(method: str, url: str, **kw) -> tuple[int, str | None]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url, **kw) as r:
            body = await r.read()
            code = json.loads(body).get("code") if r.content_type == "application/json" else None
            return r.status, code


def test_api_keys_guard_every_call_route_and_metrics(server):
    srv, _ = server(api_keys=[KEY])
    bearer = {"Authorization": f"Bearer {KEY}"}

    async def go():
        return {
            "realtime, no key": await ws_status(f"{srv.ws_url}/v1/realtime"),
            "realtime, wrong key": await ws_status(f"{srv.ws_url}/v1/realtime", headers={"Authorization": "Bearer x"}),
            "realtime, bearer": await ws_status(f"{srv.ws_url}/v1/realtime", headers=bearer),
            "realtime, subprotocol": await ws_status(f"{srv.ws_url}/v1/realtime",
                                                     protocols=("realtime", f"openai-insecure-api-key.{KEY}")),
            "native, no key": await ws_status(f"{srv.ws_url}/generate/ws"),
            "native, bearer": await ws_status(f"{srv.ws_url}/generate/ws", headers=bearer),
            "upload, no key": await http_status("POST", f"{srv.url}/generate", data=wav_bytes(tone(0.2))),
            "upload, bearer": await http_status("POST", f"{srv.url}/generate", data=wav_bytes(tone(0.2)),
                                                headers=bearer),
            "metrics, no key": await http_status("GET", f"{srv.url}/metrics"),
            "metrics, bearer": await http_status("GET", f"{srv.url}/metrics", headers=bearer),
            "health": await http_status("GET", f"{srv.url}/health"),
            "page": await http_status("GET", f"{srv.url}/"),
        }

    got = asyncio.run(go())
    assert got == {
        "realtime, no key": (401, None), "realtime, wrong key": (401, None), "realtime, bearer": (101, None),
        "realtime, subprotocol": (101, "realtime"),   # the key's subprotocol is never echoed
        "native, no key": (401, None), "native, bearer": (101, None),
        "upload, no key": (401, "unauthorized"), "upload, bearer": (200, None),
        "metrics, no key": (401, "unauthorized"), "metrics, bearer": (200, None),
        "health": (200, None), "page": (200, None)}
    srv.wait_idle()


def test_the_openai_sdk_passes_its_key(server):
    from openai import AsyncOpenAI

    srv, _ = server(api_keys=[KEY])

    async def call(key):
        client = AsyncOpenAI(api_key=key, base_url=f"{srv.url}/v1", max_retries=0)
        try:
            async with client.realtime.connect(model="m") as conn:
                await conn.session.update(session={"type": "realtime"})
                pcm = (tone(0.16) * 32767).astype("<i2").tobytes()
                await conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
                await conn.send({"type": "input_audio_buffer.commit", "final": True})
                return [ev.type async for ev in conn]
        finally:
            await client.close()

    kinds = asyncio.run(call(KEY))
    assert kinds[0] == "session.created" and kinds[-1] == "session.closed"
    with pytest.raises(Exception, match="401"):
        asyncio.run(call("sk-wrong"))
    srv.wait_idle()


def test_foreign_origins_are_refused_unless_allowed(server):
    srv, _ = server(allowed_origins=["https://app.example"])

    async def go():
        own = f"http://127.0.0.1:{srv.port}"
        return [await ws_status(f"{srv.ws_url}/v1/realtime", headers={"Origin": o})
                for o in ("https://evil.example", own, "https://app.example")] + [
            await http_status("POST", f"{srv.url}/generate", data=wav_bytes(tone(0.2)),
                              headers={"Origin": "https://evil.example"})]

    assert asyncio.run(go()) == [(403, None), (101, None), (101, None), (403, "origin_not_allowed")]
    srv.wait_idle()


def test_cors_is_off_unless_configured(server):
    async def preflight(srv):
        async with aiohttp.ClientSession() as http:
            async with http.options(f"{srv.url}/generate", headers={
                    "Origin": "https://app.example", "Access-Control-Request-Method": "POST"}) as r:
                return r.headers.get("access-control-allow-origin")

    off, _ = server()
    on, _ = server(cors_origins=["https://app.example"], allowed_origins=["https://app.example"])
    assert asyncio.run(preflight(off)) is None
    assert asyncio.run(preflight(on)) == "https://app.example"


def test_keys_from_a_file_and_the_warning_for_an_open_bind(tmp_path, caplog):
    keys = tmp_path / "keys.txt"
    keys.write_text("# ops\nsk-a\n\n  sk-b  \n")
    access = Access.from_config(ServeConfig(api_keys=["sk-c"], api_keys_file=str(keys)))
    assert access.keys == ("sk-c", "sk-a", "sk-b")
    assert access.refusal(Headers({"authorization": "Bearer sk-b"}), "http") is None
    with caplog.at_level("WARNING"):
        Access.from_config(ServeConfig(host="0.0.0.0"))
    assert "without serve.api_keys" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        Access.from_config(ServeConfig(host="0.0.0.0", api_keys=["k"]))
        Access.from_config(ServeConfig())
    assert caplog.text == ""
    with pytest.raises(FileNotFoundError, match="serve.api_keys_file"):
        Access.from_config(ServeConfig(api_keys_file=str(tmp_path / "none")))



def test_the_call_script_takes_the_servers_key(server, tmp_path):
    """scripts/call.py against a server with keys: without one it stops with the refusal and how to give the key
    (no traceback); with a wrong one it says so; with the key (--api-key, or NEMO_DUPLEX_API_KEY) the call
    completes."""
    import os
    import subprocess
    import sys

    srv, _ = server(api_keys=[KEY])
    clip = tmp_path / "in.wav"
    clip.write_bytes(wav_bytes(tone(0.4)))

    def call(*args, env_key=None):
        env = {k: v for k, v in os.environ.items() if k != "NEMO_DUPLEX_API_KEY"}
        if env_key is not None:
            env["NEMO_DUPLEX_API_KEY"] = env_key
        return subprocess.run([sys.executable, "scripts/call.py", str(clip), "--url", srv.url, "--fast",
                               "--out", str(tmp_path / "out"), *args], capture_output=True, text=True, env=env,
                              timeout=120)

    for r, says in ((call(), "refused: HTTP 401: the server wants an API key (--api-key, or NEMO_DUPLEX_API_KEY)"),
                    (call("--api-key", "sk-wrong"), "refused: HTTP 401: the server does not take this API key")):
        assert r.returncode == 1 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    for r in (call("--api-key", KEY), call(env_key=KEY)):
        assert r.returncode == 0, r.stderr[-2000:]
        events = [json.loads(x) for x in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
        assert events[-1] == {"type": "ended", "reason": "completed"}
    srv.wait_idle()
