"""Realtime client secrets (server/client_secrets.py): minted with a real key by the official SDK's call, they
open Realtime calls with their session's settings, and nothing else; bad requests are refused naming the field
or the limit; an expired secret opens nothing."""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import time

import pytest

from tests.server_support import tone, wav_bytes
from tests.test_server_access import KEY, http_status, ws_status


async def sdk_call(url: str, key: str, update: dict | None = None) -> list:
    """A short Realtime call through the official SDK with `key`: its events."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(api_key=key, base_url=f"{url}/v1", max_retries=0)
    try:
        async with client.realtime.connect(model="m") as conn:
            if update is not None:
                await conn.session.update(session=update)
            pcm = (tone(0.16) * 32767).astype("<i2").tobytes()
            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
            await conn.send({"type": "input_audio_buffer.commit", "final": True})
            return [ev async for ev in conn]
    finally:
        await client.close()


async def mint(url: str, key: str, **kw):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(api_key=key, base_url=f"{url}/v1", max_retries=0)
    try:
        return await client.realtime.client_secrets.create(**kw)
    finally:
        await client.close()


def test_a_client_secret_opens_realtime_calls_with_its_session_and_nothing_else(server, tok):
    """Minted by `client.realtime.client_secrets.create` with the server's key: an `ek_` value, its expiry, and
    the session it sets. A call opened with it (the SDK's api_key) starts with that session (its instructions
    are the call's prompt, its voice name the checkpoint's); a session.update still applies. The same value is
    refused (401) for uploads, the native socket, /metrics and another mint; the real key mints, a wrong one
    does not."""
    srv, model = server(api_keys=[KEY])
    t0 = time.time()
    secret = asyncio.run(mint(srv.url, KEY, expires_after={"anchor": "created_at", "seconds": 60},
                              session={"type": "realtime", "instructions": "Be brief.", "audio": {
                                  "output": {"voice": "marin"}}}))
    assert secret.value.startswith("ek_") and t0 + 59 <= secret.expires_at <= time.time() + 61
    assert secret.session.instructions == "Be brief."
    events = asyncio.run(sdk_call(srv.url, secret.value))
    assert events[0].type == "session.created" and events[-1].type == "session.closed"
    assert events[0].session.instructions == "Be brief."
    assert events[0].session.audio.output.voice == model.cfg.talker.speaker
    assert "Be brief." in tok.decode(model.prompts[-1][1:-1])
    events = asyncio.run(sdk_call(srv.url, secret.value, {"type": "realtime", "instructions": "Say hi."}))
    assert events[-1].type == "session.closed" and "Say hi." in tok.decode(model.prompts[-1][1:-1])
    ek = {"Authorization": f"Bearer {secret.value}"}

    async def elsewhere():
        return {
            "realtime, subprotocol": await ws_status(f"{srv.ws_url}/v1/realtime",
                                                     protocols=("realtime", f"openai-insecure-api-key.{secret.value}")),
            "upload": await http_status("POST", f"{srv.url}/generate", data=wav_bytes(tone(0.2)), headers=ek),
            "native": await ws_status(f"{srv.ws_url}/generate/ws", headers=ek),
            "metrics": await http_status("GET", f"{srv.url}/metrics", headers=ek),
            "mint": await http_status("POST", f"{srv.url}/v1/realtime/client_secrets", json={}, headers=ek),
            "mint, no key": await http_status("POST", f"{srv.url}/v1/realtime/client_secrets", json={}),
        }
    assert asyncio.run(elsewhere()) == {
        "realtime, subprotocol": (101, "realtime"), "upload": (401, "unauthorized"), "native": (401, None),
        "metrics": (401, "unauthorized"), "mint": (401, "unauthorized"), "mint, no key": (401, "unauthorized")}
    srv.wait_idle()


def test_an_expired_client_secret_opens_nothing(server):
    """Past its expiry a secret is refused like a wrong key (the expiry moved into the past here, not waited
    for: OpenAI's shortest is 10 s)."""
    srv, _ = server(api_keys=[KEY])
    secret = asyncio.run(mint(srv.url, KEY, expires_after={"anchor": "created_at", "seconds": 10}))
    ek = {"Authorization": f"Bearer {secret.value}"}
    assert asyncio.run(ws_status(f"{srv.ws_url}/v1/realtime", headers=ek)) == (101, None)
    live = srv.server.client_secrets._live
    live[secret.value] = dataclasses.replace(live[secret.value], expires_mono=time.monotonic() - 0.1)
    assert asyncio.run(ws_status(f"{srv.ws_url}/v1/realtime", headers=ek)) == (401, None)
    assert secret.value not in live
    srv.wait_idle()


@pytest.mark.parametrize("body, status, code, says", [
    ({"expires_after": {"seconds": 9}}, 400, "invalid_event", "expires_after.seconds"),
    ({"expires_after": {"seconds": 7201}}, 400, "invalid_event", "[10, 7200]"),
    ({"expires_after": {"seconds": True}}, 400, "invalid_event", "expires_after.seconds"),
    ({"expires_after": {"anchor": "now", "seconds": 60}}, 400, "invalid_event", "expires_after.anchor"),
    ({"expires_after": 60}, 400, "invalid_event", "expires_after"),
    ({"session": {"type": "transcription"}}, 400, "not_supported", "session.type"),
    ({"session": {"type": "realtime", "audio": {"output": {"voice": "nobody"}}}}, 400, "unknown_voice", "voice"),
    ({"session": {"type": "realtime", "temperature": 1e308}}, 400, "invalid_sampling", "session.temperature"),
    ({"session": "realtime"}, 400, "invalid_event", "session"),
    ([1, 2], 400, "invalid_event", "JSON object"),
    ("not json", 400, "invalid_event", "not JSON"),
    ({"session": {"type": "realtime", "instructions": "x" * 70_000}}, 413, "body_too_large", "65536 bytes"),
])
def test_a_bad_mint_is_refused_naming_the_field_or_the_limit(server, body, status, code, says):
    import json

    import aiohttp

    srv, _ = server(api_keys=[KEY])

    async def go():
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{srv.url}/v1/realtime/client_secrets", data=data,
                                 headers={"Authorization": f"Bearer {KEY}",
                                          "Content-Type": "application/json"}) as r:
                return r.status, await r.json()
    got_status, got = asyncio.run(go())
    assert (got_status, got["code"]) == (status, code) and says in got["message"] + str(got.get("param")), got
    assert srv.server.client_secrets._live == {}


def test_live_client_secrets_are_bounded(server):
    """serve.max_client_secrets: a mint past the live count is refused (429) naming it, not the oldest dropped;
    without keys anyone may mint, and the secret still sets the call's starting session."""
    srv, model = server(max_client_secrets=2)
    values = [asyncio.run(mint(srv.url, "unused")).value for _ in range(2)]
    assert len(set(values)) == 2
    status = asyncio.run(http_status("POST", f"{srv.url}/v1/realtime/client_secrets", json={}))
    assert status == (429, "too_many_client_secrets")
    body = asyncio.run(_post_json(f"{srv.url}/v1/realtime/client_secrets", {}))
    assert "serve.max_client_secrets = 2" in body["message"]
    assert all(v in srv.server.client_secrets._live for v in values)


async def _post_json(url: str, body: dict) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body) as r:
            return await r.json()


def test_the_secret_that_opened_a_call_resumes_it_after_it_expired(server):
    """OpenAI's rule: a call opened with a secret goes on past the secret's expiry. Going on includes a resume
    after a lost connection: the secret that opened the call is taken for it, expired or not; an expired secret
    that did not open the call is not (401)."""
    from tests.test_resume import Client, appends, realtime_open, realtime_packets, refused

    srv, _ = server(api_keys=[KEY])
    opener, stranger = (asyncio.run(mint(srv.url, KEY)).value for _ in range(2))

    def expire(value):
        live = srv.server.client_secrets._live
        live[value] = dataclasses.replace(live[value], expires_mono=time.monotonic() - 0.1)

    async def go():
        c, token = await realtime_open(srv.ws_url, headers={"Authorization": f"Bearer {opener}"})
        await appends(c, tone(0.16))
        await c.take(lambda got: len(realtime_packets(got)) >= 2)
        c.lose()
        expire(opener)
        expire(stranger)
        resume = f"{srv.ws_url}/v1/realtime?resume={token}&received={len(c.got)}"
        with pytest.raises(Exception) as e:
            await Client.open(resume, {"Authorization": f"Bearer {stranger}"})
        assert refused(e.value)[0] == 401
        back = await Client.open(resume, {"Authorization": f"Bearer {opener}"})
        await appends(back, tone(0.16))
        await back.ws.send('{"type": "input_audio_buffer.commit", "final": true}')
        assert await back.to_end() == 1000
        return realtime_packets(c.got) + realtime_packets(back.got)

    packets = asyncio.run(go())
    assert [frame for frame, _ in packets] == list(range(4))
    srv.wait_idle()
