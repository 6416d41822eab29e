"""Call the server with a WAV, as a caller would, over the native protocol (/generate/ws).

    python scripts/call.py clip.wav                       # paced: one 80 ms append every 80 ms (default)
    python scripts/call.py clip.wav --fast                # as fast as the server takes it
    python scripts/call.py clip.wav --url http://host:8000 --seed 3 --prompt "You are Aria." --tail 2
    python scripts/call.py clip.wav --api-key sk-...      # a server with serve.api_keys (or NEMO_DUPLEX_API_KEY)

Writes to --out (default outputs/call/<timestamp>/): agent.wav (22.05 kHz), agent.txt (the agent's text
by turn), user.txt (the RNN-T transcript), lag.tsv (per frame: server lag, and client lag = packet
arrival - sending of the frame's last input sample), events.jsonl (every JSON event). A connection lost
mid-call is resumed (docs/protocol.md, "Reconnecting a lost connection"); the audio sent meanwhile is lost.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_duplex.audio import read_wav, to_pcm16, write_wav  # noqa: E402

FRAME_S = 0.08
HEADER = struct.Struct("<If")


async def call(args) -> Path:
    audio = read_wav(args.clip, 16000)
    if args.tail > 0:   # trailing silence: the reply budget is the input duration (LANDSCAPE 0)
        audio = np.concatenate([audio, np.zeros(int(args.tail * 16000), np.float32)])
    pcm = to_pcm16(audio).tobytes()
    frame_bytes = 2 * 1280
    n_frames = -(-len(pcm) // frame_bytes)
    out = Path(args.out or f"outputs/call/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    out.mkdir(parents=True, exist_ok=True)
    ws_url = args.url.replace("http", "ws", 1).rstrip("/") + "/generate/ws"
    opening = {"type": "start", "seed": args.seed, "sample_rate": 16000, "temperature": args.temperature}
    if args.prompt:
        opening["prompt"] = args.prompt

    sent_at: dict[int, float] = {}   # frame -> when its last input sample went out
    packets: list[np.ndarray] = []
    lags: list[tuple[int, float, float]] = []
    events: list[dict] = []
    agent_turns, user_text = [""], ""
    received = 0

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(headers=headers) as http:
        try:
            ws = await http.ws_connect(ws_url, max_msg_size=0)
        except aiohttp.WSServerHandshakeError as e:   # refused before the upgrade: a plain HTTP answer
            why = {401: ": the server wants an API key (--api-key, or NEMO_DUPLEX_API_KEY)" if not args.api_key
                   else ": the server does not take this API key", 403: ": this origin is not allowed"}
            raise SystemExit(f"refused: HTTP {e.status}{why.get(e.status, '')}") from None
        except (ConnectionError, aiohttp.ClientConnectionError) as e:
            raise SystemExit(f"no server at {args.url}: {e}") from None
        await ws.send_json(opening)
        started = json.loads((await ws.receive()).data)
        if started.get("type") != "started":
            raise SystemExit(f"refused: {started}")
        budget = int(started["limits"]["max_pending_s"] / FRAME_S) // 2
        resume = started.get("resume")   # {token, grace_s}: the call can be taken back after a lost connection
        line = {"ws": ws, "messages": 1, "resumes": 0, "input_done": False, "drained": False}

        async def send_on_line(data) -> None:
            try:
                await (line["ws"].send_bytes(data) if isinstance(data, bytes) else line["ws"].send_json(data))
            except (ConnectionError, RuntimeError, aiohttp.ClientError):
                pass   # the connection is lost: this audio is too (the call hears what comes after the resume)

        async def send():
            t0 = time.monotonic()
            for k in range(n_frames):
                if args.fast:
                    while k - received > budget:     # stay inside the pending-input budget
                        await asyncio.sleep(FRAME_S / 4)
                else:
                    await asyncio.sleep(max(0.0, t0 + k * FRAME_S - time.monotonic()))
                await send_on_line(pcm[k * frame_bytes:(k + 1) * frame_bytes])
                sent_at[k] = time.monotonic()
            line["input_done"] = True
            await send_on_line({"type": "end_input"})

        async def take_back() -> bool:
            """The connection was lost mid-call: open a new one that resumes the call, retrying for the grace."""
            deadline = time.monotonic() + resume["grace_s"]
            while time.monotonic() < deadline:
                try:
                    line["ws"] = await http.ws_connect(f"{ws_url}?resume={resume['token']}&received={line['messages']}",
                                                       max_msg_size=0)
                except aiohttp.WSServerHandshakeError as e:
                    if e.status in (400, 404, 409):   # the server cannot give the call back
                        tqdm.write(f"resume refused ({e.status})")
                        return False
                except (ConnectionError, aiohttp.ClientError):
                    pass
                else:
                    line["resumes"] += 1
                    tqdm.write(f"connection lost: resumed after {line['messages']} messages")
                    if line["input_done"] and not line["drained"]:   # the end may have been lost with it
                        await send_on_line({"type": "end_input"})
                    return True
                await asyncio.sleep(0.25)
            return False

        sender = asyncio.create_task(send())
        with tqdm(total=n_frames, unit="frame", desc=Path(args.clip).name) as bar:
            while True:
                async for m in line["ws"]:
                    if m.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                        continue
                    line["messages"] += 1
                    if m.type == aiohttp.WSMsgType.BINARY:
                        k, server_lag_ms = HEADER.unpack_from(m.data)
                        now = time.monotonic()
                        packets.append(np.frombuffer(m.data[HEADER.size:], "<i2"))
                        lags.append((k, server_lag_ms, (now - sent_at.get(k, now)) * 1000.0))
                        received += 1
                        bar.update(1)
                        continue
                    ev = json.loads(m.data)
                    events.append(ev)
                    if ev["type"] == "text":
                        agent_turns[-1] += ev["delta"]
                    elif ev["type"] == "turn" and ev["event"] == "end" and agent_turns[-1]:
                        agent_turns.append("")
                    elif ev["type"] == "transcript":
                        user_text += ev["delta"]
                    elif ev["type"] == "drained":
                        line["drained"] = True
                    elif ev["type"] == "error" and not (ev["code"] == "append_after_end" and line["resumes"]):
                        tqdm.write(f"error {ev['code']}: {ev['message']}")
                lost = line["ws"].close_code in (None, 1006)   # no close frame from the server
                if not (lost and resume and await take_back()):
                    break
            sender.cancel()
    rate = started["output"]["sample_rate"]
    wav = np.concatenate(packets).astype(np.float32) / 32768.0 if packets else np.zeros(0, np.float32)
    write_wav(out / "agent.wav", wav, rate)
    (out / "agent.txt").write_text("\n".join(t for t in agent_turns if t) + "\n")
    (out / "user.txt").write_text(user_text + "\n")
    with open(out / "lag.tsv", "w") as f:
        f.write("frame\tserver_lag_ms\tclient_lag_ms\n")
        for k, s, c in lags:
            f.write(f"{k}\t{s:.2f}\t{c:.2f}\n")
    with open(out / "events.jsonl", "w") as f:
        for ev in events:
            f.write(json.dumps(ev) + "\n")
    ended = [e for e in events if e["type"] in ("ended", "error")]
    client = np.array([c for *_, c in lags]) if lags else np.zeros(1)
    resumed = f", resumed {line['resumes']}x" if line["resumes"] else ""
    print(f"{received}/{n_frames} frames, {len(wav) / rate:.2f} s of agent audio; client lag p50 "
          f"{np.percentile(client, 50):.0f} ms, p99 {np.percentile(client, 99):.0f} ms{resumed}; "
          f"end: {ended[-1] if ended else 'socket closed'} -> {out}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("clip", help="16 kHz mono PCM16 WAV")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--realtime", action="store_true", help="paced 80 ms appends (the default)")
    pace.add_argument("--fast", action="store_true", help="as fast as the server takes input")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompt", default=None, help="system prompt")
    p.add_argument("--tail", type=float, default=0.0, help="seconds of silence appended (room to answer)")
    p.add_argument("--out", default=None)
    p.add_argument("--api-key", default=os.environ.get("NEMO_DUPLEX_API_KEY"),
                   help="the server's key (serve.api_keys), sent as a Bearer token; default: $NEMO_DUPLEX_API_KEY")
    asyncio.run(call(p.parse_args()))


if __name__ == "__main__":
    main()
