"""The OpenAI Realtime protocol on top of a duplex call: reading client events and writing server events.

Names are the GA ones (`response.output_audio.delta`, ...); on input the beta spellings are accepted too
(LANDSCAPE 2.1). Nothing here touches a socket or the engine: `parse_session` turns a `session.update`
into call settings, `RealtimeOutput` turns what a frame says (`server.FrameOutputs`) into server events.

The model is full duplex (spec 1.3): it hears and speaks on every 80 ms frame, with no turn detection
and no "create a response" step. So the mapping is: one response is open at a time and carries every
frame's audio packet; the model's EOS on the text channel ends it and the next frame opens the next one
(the continuous-response convention of SGLang-Omni, LANDSCAPE 2.3); a BOS after text also starts a new
one. `response.cancel` fences the rest of the current agent turn: its audio and text are dropped until
the model's next turn boundary, while the call (input and model state) goes on.

One file past 500 lines on purpose: every Realtime event name, field and shape the server reads or writes is
here, so the protocol reads in one place beside docs/protocol.md.
"""
from __future__ import annotations

import base64
import itertools
import json
import math
import re
from dataclasses import dataclass, field

from nemo_duplex.audio import ENCODINGS, G711_RATE, AudioFormat, AudioFormatError

# Error codes -> the Realtime error class they belong to (the `error.type` field).
ERROR_TYPES = {
    "busy": "rate_limit_error",
    "server_error": "server_error",
    "engine_error": "server_error",
    "server_shutdown": "server_error",
    "replica_failed": "server_error",
}

# Beta event names a client may send, mapped to the GA name we handle.
CLIENT_ALIASES = {
    "input_audio_buffer.append": "input_audio_buffer.append",
    "transcription_session.update": "session.update",
    "session.close": "session.close",
    "session.ping": "session.ping",
}

# Every client event, by what the server does with it (docs/protocol.md's table lists the same, with why;
# tests/test_realtime_events.py reads both).
CLIENT_EVENTS = {"session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                 "input_audio_buffer.clear", "conversation.item.create", "response.cancel", "session.close",
                 "session.ping"}
# valid, but with no meaning for a full-duplex model: acknowledged by silence (the model answers on its own;
# there is no turn to create)
NO_OP_EVENTS = {"response.create", "output_audio_buffer.clear"}
# valid, refused with not_supported: the model hears audio only and its history is its state
NOT_SUPPORTED_EVENTS = {"conversation.item.retrieve", "conversation.item.delete", "conversation.item.truncate"}

# Every event the server sends (RealtimeOutput.ev refuses any other).
SERVER_EVENTS = {
    "session.created", "session.updated", "session.closed", "session.pong", "error",
    "response.created", "response.output_item.added", "response.content_part.added",
    "response.output_audio.delta", "response.output_audio_transcript.delta", "response.output_text.delta",
    "response.output_audio.done", "response.output_audio_transcript.done", "response.output_text.done",
    "response.content_part.done", "response.output_item.done", "response.done",
    "response.function_call_arguments.delta", "response.function_call_arguments.done",
    "conversation.item.added", "conversation.item.done",
    "conversation.item.input_audio_transcription.delta", "conversation.item.input_audio_transcription.completed",
    "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
    "input_audio_buffer.cleared", "input_audio_buffer.drained",
}


class ProtocolError(Exception):
    """A client event we refuse; `code` is the documented error code, `param` the offending field."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def error_event(event_id: str, code: str, message: str, param: str | None = None,
                client_event_id: str | None = None) -> dict:
    return {"type": "error", "event_id": event_id,
            "error": {"type": ERROR_TYPES.get(code, "invalid_request_error"), "code": code, "message": message,
                      "param": param, "event_id": client_event_id}}


# ---- reading client events ---------------------------------------------------------------------------
# A lone UTF-16 surrogate can only enter through a JSON escape (a WebSocket text frame is valid UTF-8)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _surrogate_path(v: object, path: str) -> str | None:
    """The path of the first string in `v` holding a lone surrogate (it cannot be encoded as UTF-8)."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(v, dict):
        for k, x in v.items():
            if (found := _surrogate_path(k, path) or _surrogate_path(x, f"{path}.{k}" if path else str(k))):
                return found
    elif isinstance(v, list):
        for i, x in enumerate(v):
            if (found := _surrogate_path(x, f"{path}[{i}]")):
                return found
    return None


def parse_client_event(raw: str) -> dict:
    """A text frame -> the event dict with its GA `type`. Null fields count as absent."""
    try:
        ev = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ProtocolError("invalid_event", f"not JSON: {e}") from None
    if not isinstance(ev, dict):
        raise ProtocolError("invalid_event", "an event must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw) and (where := _surrogate_path(ev, "")) is not None:
        # (paired surrogates are one character after json.loads; a lone one is not text)
        raise ProtocolError("invalid_event", f"{where}: a lone UTF-16 surrogate is not text", where)
    ev = {k: v for k, v in ev.items() if v is not None}
    kind = ev.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("invalid_event", "the event has no string 'type'", "type")
    ev["type"] = CLIENT_ALIASES.get(kind, kind)
    return ev


def field_of(obj: dict, name: str, kind, where: str):
    """obj[name] if present and of `kind` (None when absent or null), else invalid_event naming it."""
    v = obj.get(name)
    if v is None:
        return None
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or (kind in (int, float) and isinstance(v, bool)):
        raise ProtocolError("invalid_event", f"{where}.{name} must be {getattr(kind, '__name__', kind)}",
                            f"{where}.{name}")
    if kind is float and not math.isfinite(v):
        raise ProtocolError("invalid_event", f"{where}.{name} must be a finite number", f"{where}.{name}")
    return v


# The range of each number a session may set: the message names the limit
SEED_LIMIT = 2 ** 63          # the engine keeps seeds as int64
SAMPLING_LIMITS = {"temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "repetition_penalty": (0.0, 100.0)}


def decode_audio(b64: object, param: str = "audio") -> bytes:
    if not isinstance(b64, str):
        raise ProtocolError("invalid_event", f"{param} must be a base64 string", param)
    try:
        data = base64.b64decode(b64, validate=True)
    except ValueError as e:
        raise ProtocolError("invalid_audio", f"{param} is not valid base64: {e}", param) from None
    return data


REALTIME_FORMAT = AudioFormat("pcm16", 24000)   # OpenAI Realtime's default, both ways
BETA_FORMATS = {spec.realtime_beta: REALTIME_FORMAT if encoding == "pcm16" else AudioFormat(encoding, G711_RATE)
                for encoding, spec in ENCODINGS.items()}
GA_ENCODINGS = {spec.media_type: encoding for encoding, spec in ENCODINGS.items()}
# OpenAI's stock voices: clients send one by default (the Agents SDK "ash"); here each means the checkpoint's
# own default voice, which session.updated then names
OPENAI_VOICES = {"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
                 "marin", "cedar"}


@dataclass
class SessionSettings:
    """What a `session.update` may set. Fixed once audio has started (the prompt is prefilled then)."""
    instructions: str | None = None
    tools: list[dict] = field(default_factory=list)
    voice: str | None = None
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    input_format: AudioFormat = REALTIME_FORMAT
    output_format: AudioFormat = REALTIME_FORMAT
    output_modalities: tuple[str, ...] = ("audio",)   # ("text",): the agent's text only, no audio events
    # the call's own limit in seconds of input, at most the server's engine.max_call_s (None: that limit). An
    # extension (OpenAI's Realtime has no such field): a call that says it is short holds less of the
    # engine's memory, which leaves room for more calls
    max_call_s: float | None = None


def parse_format(fmt: object, param: str) -> AudioFormat:
    """GA `{"type": "audio/pcm", "rate": r}` (rate 24000 when absent), `{"type": "audio/pcmu"}` or
    `{"type": "audio/pcma"}` (G.711, 8 kHz), or a beta name ("pcm16": 24 kHz, "g711_ulaw", "g711_alaw")."""
    if isinstance(fmt, str):
        if fmt not in BETA_FORMATS:
            raise ProtocolError("invalid_audio_format", f"{param} {fmt!r}: one of {sorted(BETA_FORMATS)}", param)
        return BETA_FORMATS[fmt]
    if not isinstance(fmt, dict):
        raise ProtocolError("invalid_event", f"{param} must be an object or a format name", param)
    kind = fmt.get("type", "audio/pcm")
    if kind not in GA_ENCODINGS:
        raise ProtocolError("invalid_audio_format", f"{param}.type {kind!r}: one of {sorted(GA_ENCODINGS)}",
                            f"{param}.type")
    encoding = GA_ENCODINGS[kind]
    rate = fmt.get("rate", REALTIME_FORMAT.rate if encoding == "pcm16" else G711_RATE)
    if not isinstance(rate, int) or isinstance(rate, bool):
        raise ProtocolError("invalid_event", f"{param}.rate must be an integer", f"{param}.rate")
    try:
        return AudioFormat(encoding, rate)
    except AudioFormatError as e:
        raise ProtocolError("invalid_audio_format", f"{param}: {e}", param) from None


def format_object(fmt: AudioFormat) -> dict:
    return {"type": ENCODINGS[fmt.encoding].media_type, "rate": fmt.rate}


def parse_modalities(value: object, param: str) -> tuple[str, ...]:
    """["audio"] (the agent's speech with its transcript) or ["text"] (its text only); the beta
    ["audio", "text"] means ["audio"]."""
    if not isinstance(value, list) or not value or not all(isinstance(m, str) for m in value):
        raise ProtocolError("invalid_event", f"{param} must be a list of strings", param)
    if set(value) - {"audio", "text"}:
        raise ProtocolError("invalid_event", f"{param} {value}: 'audio' or 'text'", param)
    return ("audio",) if "audio" in value else ("text",)


def parse_session(session: object, current: SessionSettings, max_tools: int, max_call_s: float) -> SessionSettings:
    """Apply a `session.update` body (GA or beta shape) to `current`; unknown fields are ignored. `max_call_s`
    is the server's engine.max_call_s, the most a call may declare as its own limit."""
    if not isinstance(session, dict):
        raise ProtocolError("invalid_event", "session must be an object", "session")
    s = {k: v for k, v in session.items() if v is not None}
    new = SessionSettings(**current.__dict__)
    if "instructions" in s:
        new.instructions = field_of(s, "instructions", str, "session")
    if "tools" in s:
        tools = field_of(s, "tools", list, "session")
        if len(tools) > max_tools:
            raise ProtocolError("too_many_tools", f"{len(tools)} tools; the limit is serve.max_tools = {max_tools}",
                                "session.tools")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
                raise ProtocolError("invalid_event", f"session.tools[{i}] needs a string 'name'",
                                    f"session.tools[{i}]")
            if t.get("type", "function") != "function":
                raise ProtocolError("not_supported", f"session.tools[{i}].type {t['type']!r}: only 'function' "
                                    f"tools exist here", f"session.tools[{i}].type")
        new.tools = [dict(t) for t in tools]
    for name in ("temperature", "top_p", "repetition_penalty"):
        if name in s:
            v = field_of(s, name, float, "session")
            low, high = SAMPLING_LIMITS[name]
            if not (low <= v <= high):
                raise ProtocolError("invalid_sampling", f"session.{name} {v:g}: the limit is [{low:g}, {high:g}]",
                                    f"session.{name}")
            setattr(new, name, v)
    if "seed" in s:
        seed = field_of(s, "seed", int, "session")
        if not 0 <= seed < SEED_LIMIT:
            raise ProtocolError("invalid_event", f"session.seed {seed}: the limit is 0 <= seed < 2^63", "session.seed")
        new.seed = seed
    if "max_call_s" in s:
        limit = field_of(s, "max_call_s", float, "session")
        if not 0 < limit <= max_call_s:
            raise ProtocolError("invalid_event", f"session.max_call_s {limit:g}: the limit is 0 < max_call_s <= "
                                f"engine.max_call_s = {max_call_s:g} s", "session.max_call_s")
        new.max_call_s = limit
    # voice: GA audio.output.voice (a name or {"id": name}), beta voice
    if "voice" in s:
        new.voice = field_of(s, "voice", str, "session")
    audio = field_of(s, "audio", dict, "session") or {}
    inp = field_of(audio, "input", dict, "session.audio") or {}
    out = field_of(audio, "output", dict, "session.audio") or {}
    if inp.get("format") is not None:
        new.input_format = parse_format(inp["format"], "session.audio.input.format")
    if out.get("format") is not None:
        new.output_format = parse_format(out["format"], "session.audio.output.format")
    if out.get("voice") is not None:
        v = out["voice"]
        if isinstance(v, dict):
            v = field_of(v, "id", str, "session.audio.output.voice")
        elif not isinstance(v, str):
            raise ProtocolError("invalid_event", "session.audio.output.voice must be a string or {\"id\": string}",
                                "session.audio.output.voice")
        new.voice = v
    if "input_audio_format" in s:
        new.input_format = parse_format(s["input_audio_format"], "session.input_audio_format")
    if "output_audio_format" in s:
        new.output_format = parse_format(s["output_audio_format"], "session.output_audio_format")
    for name in ("output_modalities", "modalities"):
        if name in s:
            new.output_modalities = parse_modalities(s[name], f"session.{name}")
    return new


def session_object(call_id: str, model_name: str, settings: SessionSettings, voice: str,
                   capabilities: dict) -> dict:
    """The `session` body of `session.created` / `session.updated` (GA shape plus our extensions)."""
    return {
        "id": call_id, "object": "realtime.session", "type": "realtime", "model": model_name,
        "output_modalities": list(settings.output_modalities), "instructions": settings.instructions or "",
        "tools": settings.tools, "tool_choice": "auto",
        "audio": {"input": {"format": format_object(settings.input_format), "turn_detection": None,
                            "transcription": {"model": "rnnt"}},
                  "output": {"format": format_object(settings.output_format), "voice": voice}},
        "seed": settings.seed, "temperature": settings.temperature, "top_p": settings.top_p,
        "repetition_penalty": settings.repetition_penalty,
        **({"max_call_s": settings.max_call_s} if settings.max_call_s is not None else {}),
        "capabilities": capabilities,
    }


# ---- writing server events -------------------------------------------------------------------------
class EventIds:
    """Server-side ids for one connection: events, responses, items, function calls."""

    def __init__(self, call_id: str):
        self._n = itertools.count()
        self.call_id = call_id

    def next(self, prefix: str) -> str:
        return f"{prefix}_{self.call_id}_{next(self._n)}"


class RealtimeOutput:
    """Frames -> Realtime server events for one call: the response lifecycle, audio and transcript (or, with
    output_modalities ["text"], text) deltas, the user's speech and transcript, function-call items.

    The model has no VAD: `input_audio_buffer.speech_started` / `speech_stopped` follow the user transcript's
    (RNN-T) activity: started on the first frame with user tokens, stopped `hangover` frames after the last
    one (serve.speech_hangover_ms), which also commits the user item (as a client's commit does)."""

    def __init__(self, ids: EventIds, modalities: tuple[str, ...] = ("audio",), hangover: int = 10,
                 frame_ms: float = 80.0):
        self.ids = ids
        self.set_modalities(modalities)
        self.hangover, self.frame_ms = hangover, frame_ms
        self.response: dict | None = None   # the open response: ids, transcript, output items, usage counts
        self.fenced = False                 # response.cancel: drop the rest of this agent turn
        self.user_item: str | None = None
        self.user_text = ""
        self.previous_user_item: str | None = None
        self.speaking_since: int | None = None   # the frame the user's speech started on (None: not speaking)
        self.last_speech: int = -1               # the last frame with user tokens
        self.frames_heard = 0                    # frames handed out so far
        self.segment_from = 0                    # the first frame of the user's current segment

    def set_modalities(self, modalities: tuple[str, ...]) -> None:
        self.audio, self.modalities = "audio" in modalities, list(modalities)

    def ev(self, kind: str, **body) -> dict:
        if kind not in SERVER_EVENTS:
            raise ValueError(f"{kind} is not among the documented server events (SERVER_EVENTS)")
        return {"type": kind, "event_id": self.ids.next("event"), **body}

    # -- responses
    def _open(self) -> list[dict]:
        rid, iid = self.ids.next("resp"), self.ids.next("item")
        self.response = {"id": rid, "item": iid, "transcript": "", "outputs": 1, "items": [], "frames": 0,
                         "text_tokens": 0}
        item = {"id": iid, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}
        return [
            self.ev("response.created", response={"id": rid, "object": "realtime.response", "status": "in_progress",
                                                  "output": [], "output_modalities": self.modalities}),
            self.ev("response.output_item.added", response_id=rid, output_index=0, item=item),
            self.ev("conversation.item.added", previous_item_id=self.previous_user_item, item=item),
            self.ev("response.content_part.added", response_id=rid, item_id=iid, output_index=0, content_index=0,
                    part=self._part("")),
        ]

    def _part(self, text: str) -> dict:
        return {"type": "audio", "transcript": text} if self.audio else {"type": "text", "text": text}

    def close(self, status: str = "completed", reason: str | None = None) -> list[dict]:
        """End the open response (if any) with `status`: completed | cancelled | incomplete | failed."""
        r = self.response
        if r is None:
            return []
        self.response = None
        rid, iid, text = r["id"], r["item"], r["transcript"]
        where = dict(response_id=rid, item_id=iid, output_index=0, content_index=0)
        content = ({"type": "output_audio", "transcript": text} if self.audio else {"type": "output_text", "text": text})
        message = {"id": iid, "object": "realtime.item", "type": "message", "role": "assistant",
                   "status": "completed" if status == "completed" else "incomplete", "content": [content]}
        details = {"type": status, "reason": reason} if status != "completed" else None
        # usage in the model's own units: each 80 ms frame heard is an input audio token, each frame spoken
        # an output audio token, each non-empty text token of the agent an output text token
        frames, texts = r["frames"], r["text_tokens"]
        usage = {"total_tokens": frames + frames * self.audio + texts, "input_tokens": frames,
                 "output_tokens": frames * self.audio + texts,
                 "input_token_details": {"audio_tokens": frames, "text_tokens": 0, "cached_tokens": 0},
                 "output_token_details": {"audio_tokens": frames * self.audio, "text_tokens": texts}}
        if self.audio:
            events = [self.ev("response.output_audio.done", **where),
                      self.ev("response.output_audio_transcript.done", transcript=text, **where)]
        else:
            events = [self.ev("response.output_text.done", text=text, **where)]
        return events + [
            self.ev("response.content_part.done", part=self._part(text), **where),
            self.ev("response.output_item.done", response_id=rid, output_index=0, item=message),
            self.ev("conversation.item.done", item=message),
            self.ev("response.done", response={"id": rid, "object": "realtime.response", "status": status,
                                               "status_details": details, "output": [message] + r["items"],
                                               "output_modalities": self.modalities, "usage": usage}),
        ]

    def cancel(self) -> list[dict]:
        """response.cancel: close the open response as cancelled and fence the rest of this agent turn."""
        if self.response is None:
            return []
        self.fenced = True
        return self.close("cancelled", "client_cancelled")

    # -- one frame
    def frame(self, out) -> list[dict]:
        """`out` is a server.frames.FrameOutputs."""
        self.frames_heard = out.frame + 1
        events: list[dict] = self._speech(out)
        if out.turn_start and self.response is not None and self.response["transcript"]:
            events += self.close()
        if self.fenced and (out.turn_start or out.turn_end):
            self.fenced = False
            if out.turn_end:   # the fenced turn ends on this frame: nothing of it is sent
                return events + self._user(out) + self._tools(out)
        if not self.fenced:
            if self.response is None:
                events += self._open()
            r = self.response
            r["frames"] += 1
            r["text_tokens"] += out.text_token
            where = dict(response_id=r["id"], item_id=r["item"], output_index=0, content_index=0)
            if self.audio:
                # `frame` (an extension) is the model frame of this packet: clients can check order and gaps
                events.append(self.ev("response.output_audio.delta", delta=base64.b64encode(out.pcm16).decode(),
                                      frame=out.frame, **where))
            if out.text_delta:
                r["transcript"] += out.text_delta
                kind = "response.output_audio_transcript.delta" if self.audio else "response.output_text.delta"
                events.append(self.ev(kind, delta=out.text_delta, **where))
        events += self._user(out)
        events += self._tools(out)
        if out.turn_end and not self.fenced:
            events += self.close()
        return events

    def audio_tail(self, pcm: bytes, frame: int) -> list[dict]:
        """After the last frame, the output resampler's tail (the filter's delay, tens of ms) as one more
        audio delta of the open response (`frame`: the last model frame)."""
        if not pcm or not self.audio or self.fenced:
            return []
        events = self._open() if self.response is None else []
        r = self.response
        return events + [self.ev("response.output_audio.delta", delta=base64.b64encode(pcm).decode(), frame=frame,
                                 response_id=r["id"], item_id=r["item"], output_index=0, content_index=0)]

    def _speech(self, out) -> list[dict]:
        """speech_started on the first frame of user tokens; speech_stopped `hangover` frames after the last."""
        if out.user_active:
            self.last_speech = out.frame
            if self.speaking_since is None:
                self.speaking_since = out.frame
                return [self.ev("input_audio_buffer.speech_started", audio_start_ms=round(out.frame * self.frame_ms),
                                item_id=self._user_item())]
            return []
        if self.speaking_since is not None and out.frame - self.last_speech >= self.hangover:
            return self.speech_stopped()
        return []

    def speech_stopped(self) -> list[dict]:
        """The user's speech ended (its hangover passed, or the input did): speech_stopped, then the user item
        is committed as a client's commit would."""
        if self.speaking_since is None:
            return []
        self.speaking_since = None
        stopped = self.ev("input_audio_buffer.speech_stopped",
                          audio_end_ms=round((self.last_speech + 1) * self.frame_ms), item_id=self._user_item())
        return [stopped] + self.commit()

    def _user_item(self) -> str:
        if self.user_item is None:
            self.user_item, self.user_text = self.ids.next("item"), ""
        return self.user_item

    def _user(self, out) -> list[dict]:
        if not out.user_delta:
            return []
        events = []
        if self.user_item is None or not self.user_text:
            item_id = self._user_item()
            if not self.user_text:
                events.append(self.ev("conversation.item.added", previous_item_id=self.previous_user_item,
                                      item=self._user_message(item_id, "in_progress", None)))
        self.user_text += out.user_delta
        events.append(self.ev("conversation.item.input_audio_transcription.delta", item_id=self.user_item,
                              content_index=0, delta=out.user_delta))
        return events

    @staticmethod
    def _user_message(item_id: str, status: str, transcript: str | None) -> dict:
        return {"id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": status,
                "content": [{"type": "input_audio", "transcript": transcript}]}

    def commit(self) -> list[dict]:
        """input_audio_buffer.commit (or the end of the user's speech): close the user item so far (its
        transcript is complete)."""
        item = self._user_item()
        # the transcription's usage as the duration of audio it heard (the segment's frames)
        seconds = (self.frames_heard - self.segment_from) * self.frame_ms / 1000
        self.segment_from = self.frames_heard
        events = [self.ev("input_audio_buffer.committed", item_id=item, previous_item_id=self.previous_user_item),
                  self.ev("conversation.item.input_audio_transcription.completed", item_id=item, content_index=0,
                          transcript=self.user_text, usage={"type": "duration", "seconds": round(seconds, 3)}),
                  self.ev("conversation.item.done", item=self._user_message(item, "completed", self.user_text))]
        self.previous_user_item, self.user_item, self.user_text = item, None, ""
        return events

    def _tools(self, out) -> list[dict]:
        events = []
        for call in out.tool_calls:
            if self.response is None:
                events += self._open()
            r = self.response
            idx = r["outputs"]
            r["outputs"] += 1
            item = {"id": call.item_id, "object": "realtime.item", "type": "function_call", "status": "in_progress",
                    "call_id": call.call_id, "name": call.name, "arguments": ""}
            where = dict(response_id=r["id"], item_id=call.item_id, output_index=idx)
            done = dict(item, status="completed", arguments=call.arguments)
            r["items"].append(done)
            events += [
                self.ev("response.output_item.added", response_id=r["id"], output_index=idx, item=item),
                self.ev("conversation.item.added", previous_item_id=r["item"], item=item),
                self.ev("response.function_call_arguments.delta", call_id=call.call_id, delta=call.arguments,
                        **where),
                self.ev("response.function_call_arguments.done", call_id=call.call_id, name=call.name,
                        arguments=call.arguments, **where),
                self.ev("response.output_item.done", response_id=r["id"], output_index=idx, item=done),
                self.ev("conversation.item.done", item=done),
            ]
        for message in out.tool_errors:
            events.append(error_event(self.ids.next("event"), "function_call_parse_error", message))
        return events
