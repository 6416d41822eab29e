"""LiveKit Agents' OpenAI Realtime client (livekit-plugins-openai, the client vLLM-Omni's duplex work targets:
docs/protocol.md, "Clients") against the real server with a scripted frame step (tests/server_support.py)."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest

from nemo_duplex.audio import resample
from nemo_duplex.server.tools import tool_response_ids
from tests.server_support import tone
from tests.test_server import TOOLCALL

pytest.importorskip("livekit.plugins.openai")


def test_livekit_realtime_session_with_a_tool(server, tok, caplog):
    """LiveKit's RealtimeSession as an AgentSession drives it, without a room: instructions and a function tool
    set, 24 kHz PCM16 pushed in 20 ms frames, each generation's messages and function calls read as the agent
    reads them, the tool's output given back through update_chat_ctx (which waits for the server to add the
    item, else it times out). The agent's scripted words arrive as the message's text and its audio with them;
    the function call arrives whole and its output reaches the model's function channel; the instructions are
    the prompt; LiveKit reports no error and logs no event it failed to handle (it logs, not raises, those)."""
    import aiohttp
    from livekit import rtc
    from livekit.agents import function_tool, llm
    from livekit.plugins.openai.realtime import RealtimeModel

    srv, model = server(tool_on_hold_min_frames=0)
    t = model.cfg.tokens
    words = tok.encode("hello there")
    model.text[0] = [t.pad_id, t.bos_id, *words, t.eos_id]
    call = [tok.token_to_id(t.tool_call_start)] + tok.encode(TOOLCALL) + [tok.token_to_id(t.tool_call_end)]
    model.func[0] = [t.pad_id] * 8 + call
    want = tool_response_ids(tok, '{"temp": 21}', 1024)
    x = resample(tone(0.08 * (len(call) + 80), amp=0.3), 16000, 24000)
    pcm = (x * 32767).astype("<i2")
    caplog.set_level(logging.DEBUG, logger="livekit")

    @function_tool
    async def get_weather(city: str) -> str:
        """The weather in a city."""
        return '{"temp": 21}'

    async def run():
        async with aiohttp.ClientSession() as http:
            lk = RealtimeModel(base_url=f"{srv.url}/v1", api_key="unused", http_session=http)
            sess = lk.session()
            await sess.update_instructions("Be brief.")
            await sess.update_tools([get_weather])
            got = {"texts": [], "audio": 0, "errors": [], "calls": [], "events": []}
            sess.on("error", lambda e: got["errors"].append(e))
            sess.on("openai_server_event_received", lambda e: got["events"].append(e))

            async def answer(fc):
                got["calls"].append((fc.name, json.loads(fc.arguments)))
                ctx = sess.chat_ctx.copy()
                ctx.items.append(llm.FunctionCallOutput(call_id=fc.call_id, name=fc.name, output='{"temp": 21}',
                                                        is_error=False))
                await sess.update_chat_ctx(ctx)

            async def read(gen):
                async def messages():
                    async for msg in gen.message_stream:
                        async def text(m=msg):
                            got["texts"].append("".join([d async for d in m.text_stream]))

                        async def audio(m=msg):
                            async for f in m.audio_stream:
                                got["audio"] += f.samples_per_channel
                        await asyncio.gather(text(), audio())

                async def calls():
                    async for fc in gen.function_stream:
                        await answer(fc)
                await asyncio.gather(messages(), calls())
            readers = []
            sess.on("generation_created", lambda g: readers.append(asyncio.create_task(read(g))))
            for i in range(0, len(pcm), 480):
                chunk = pcm[i:i + 480]
                sess.push_audio(rtc.AudioFrame(chunk.tobytes(), 24000, 1, len(chunk)))
                await asyncio.sleep(0.02)
            for _ in range(100):
                if len([f for f in model.forced if f[0] == 0]) >= len(want):
                    break
                await asyncio.sleep(0.05)
            await sess.aclose()
            got["raised"] = [r for r in await asyncio.gather(*readers, return_exceptions=True) if r is not None]
            return got
    got = asyncio.run(asyncio.wait_for(run(), 60))
    assert got["errors"] == [] and got["raised"] == [] and not [e for e in got["events"] if e["type"] == "error"]
    failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or "failed to" in r.getMessage()]
    assert failed == []
    assert got["texts"][0] == "hello there"
    assert got["audio"] > 1920 * len(call)   # 24 kHz: 1920 samples a frame, all through the call
    assert got["calls"] == [("get_weather", {"city": "Paris"})]
    assert [tok_id for seed, _, tok_id in model.forced if seed == 0] == want
    assert "Be brief." in tok.decode(model.prompts[-1][1:-1])
    updated = [e for e in got["events"] if e["type"] == "session.updated"][-1]["session"]
    assert updated["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert updated["audio"]["output"]["voice"] == model.cfg.talker.speaker   # LiveKit's "marin" -> the checkpoint's
    srv.wait_idle()
