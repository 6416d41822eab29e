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
"""
from __future__ import annotations

import base64
import itertools
import json
from dataclasses import dataclass, field

# Error codes -> the Realtime error class they belong to (the `error.type` field).
ERROR_TYPES = {
    "busy": "rate_limit_error",
    "server_error": "server_error",
    "engine_error": "server_error",
    "server_shutdown": "server_error",
}

# Beta event names a client may send, mapped to the GA name we handle.
CLIENT_ALIASES = {
    "input_audio_buffer.append": "input_audio_buffer.append",
    "transcription_session.update": "session.update",
    "session.close": "session.close",
    "session.ping": "session.ping",
}

# Realtime client events that are valid but have no meaning for a full-duplex model: acknowledged by
# silence (the model answers on its own; there is no turn to create or history to edit).
NO_OP_EVENTS = {"response.create", "output_audio_buffer.clear"}
NOT_SUPPORTED_EVENTS = {"input_audio_buffer.clear", "conversation.item.retrieve", "conversation.item.delete",
                        "conversation.item.truncate"}


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
def parse_client_event(raw: str) -> dict:
    """A text frame -> the event dict with its GA `type`. Null fields count as absent."""
    try:
        ev = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ProtocolError("invalid_event", f"not JSON: {e}") from None
    if not isinstance(ev, dict):
        raise ProtocolError("invalid_event", "an event must be a JSON object")
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
    return v


def decode_audio(b64: object, param: str = "audio") -> bytes:
    if not isinstance(b64, str):
        raise ProtocolError("invalid_event", f"{param} must be a base64 string", param)
    try:
        data = base64.b64decode(b64, validate=True)
    except ValueError as e:
        raise ProtocolError("invalid_audio", f"{param} is not valid base64: {e}", param) from None
    if len(data) % 2:
        raise ProtocolError("invalid_audio", f"{param} has {len(data)} bytes; PCM16 needs an even count", param)
    return data


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


def check_pcm_format(fmt: object, rate: int, param: str) -> None:
    """GA `{"type": "audio/pcm", "rate": r}` or beta `"pcm16"`; anything else is refused, never resampled."""
    if isinstance(fmt, str):
        if fmt != "pcm16":
            raise ProtocolError("invalid_audio_format", f"{param} {fmt!r}: this server speaks 'pcm16' only", param)
        return
    if not isinstance(fmt, dict):
        raise ProtocolError("invalid_event", f"{param} must be an object or 'pcm16'", param)
    kind = fmt.get("type", "audio/pcm")
    if kind != "audio/pcm":
        raise ProtocolError("invalid_audio_format", f"{param}.type {kind!r}: this server speaks 'audio/pcm' "
                            f"(16-bit mono PCM) only", f"{param}.type")
    got = fmt.get("rate")
    if got is not None and got != rate:
        raise ProtocolError("invalid_audio_format", f"{param}.rate {got} Hz: this model's rate is {rate} Hz "
                            f"(audio is never resampled)", f"{param}.rate")


def parse_session(session: object, current: SessionSettings, in_rate: int, out_rate: int,
                  max_tools: int) -> SessionSettings:
    """Apply a `session.update` body (GA or beta shape) to `current`; unknown fields are ignored."""
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
            setattr(new, name, field_of(s, name, float, "session"))
    if "seed" in s:
        new.seed = field_of(s, "seed", int, "session")
    # voice: GA audio.output.voice, beta voice
    if "voice" in s:
        new.voice = field_of(s, "voice", str, "session")
    audio = field_of(s, "audio", dict, "session") or {}
    inp = field_of(audio, "input", dict, "session.audio") or {}
    out = field_of(audio, "output", dict, "session.audio") or {}
    if inp.get("format") is not None:
        check_pcm_format(inp["format"], in_rate, "session.audio.input.format")
    if out.get("format") is not None:
        check_pcm_format(out["format"], out_rate, "session.audio.output.format")
    if out.get("voice") is not None:
        v = out["voice"]
        new.voice = v if isinstance(v, str) else field_of(v, "id", str, "session.audio.output.voice")
    if "input_audio_format" in s:
        check_pcm_format(s["input_audio_format"], in_rate, "session.input_audio_format")
    if "output_audio_format" in s:
        check_pcm_format(s["output_audio_format"], out_rate, "session.output_audio_format")
    for name in ("input_sample_rate", "sample_rate", "sample_rate_hz"):
        if name in s and s[name] != in_rate:
            raise ProtocolError("invalid_audio_format", f"session.{name} {s[name]} Hz: this model takes "
                                f"{in_rate} Hz (audio is never resampled)", f"session.{name}")
    if "output_sample_rate" in s and s["output_sample_rate"] != out_rate:
        raise ProtocolError("invalid_audio_format", f"session.output_sample_rate {s['output_sample_rate']} Hz: "
                            f"this model speaks at {out_rate} Hz", "session.output_sample_rate")
    return new


def session_object(call_id: str, model_name: str, settings: SessionSettings, voice: str,
                   capabilities: dict, in_rate: int, out_rate: int) -> dict:
    """The `session` body of `session.created` / `session.updated` (GA shape plus our extensions)."""
    return {
        "id": call_id, "object": "realtime.session", "type": "realtime", "model": model_name,
        "output_modalities": ["audio"], "instructions": settings.instructions or "",
        "tools": settings.tools, "tool_choice": "auto",
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": in_rate}, "turn_detection": None,
                            "transcription": {"model": "rnnt"}},
                  "output": {"format": {"type": "audio/pcm", "rate": out_rate}, "voice": voice}},
        "seed": settings.seed, "temperature": settings.temperature, "top_p": settings.top_p,
        "repetition_penalty": settings.repetition_penalty,
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
    """Frames -> Realtime server events for one call: the response lifecycle, audio and transcript
    deltas, user-transcript deltas, function-call items."""

    def __init__(self, ids: EventIds):
        self.ids = ids
        self.response: dict | None = None   # the open response: ids, transcript, output items
        self.fenced = False                 # response.cancel: drop the rest of this agent turn
        self.user_item: str | None = None
        self.user_text = ""
        self.previous_user_item: str | None = None

    def ev(self, kind: str, **body) -> dict:
        return {"type": kind, "event_id": self.ids.next("event"), **body}

    # -- responses
    def _open(self) -> list[dict]:
        rid, iid = self.ids.next("resp"), self.ids.next("item")
        self.response = {"id": rid, "item": iid, "transcript": "", "outputs": 1, "items": []}
        item = {"id": iid, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}
        return [
            self.ev("response.created", response={"id": rid, "object": "realtime.response", "status": "in_progress",
                                                  "output": [], "output_modalities": ["audio"]}),
            self.ev("response.output_item.added", response_id=rid, output_index=0, item=item),
            self.ev("response.content_part.added", response_id=rid, item_id=iid, output_index=0, content_index=0,
                    part={"type": "audio", "transcript": ""}),
        ]

    def close(self, status: str = "completed", reason: str | None = None) -> list[dict]:
        """End the open response (if any) with `status`: completed | cancelled | incomplete | failed."""
        r = self.response
        if r is None:
            return []
        self.response = None
        rid, iid, text = r["id"], r["item"], r["transcript"]
        where = dict(response_id=rid, item_id=iid, output_index=0, content_index=0)
        message = {"id": iid, "object": "realtime.item", "type": "message", "role": "assistant",
                   "status": "completed" if status == "completed" else "incomplete",
                   "content": [{"type": "output_audio", "transcript": text}]}
        details = {"type": status, "reason": reason} if status != "completed" else None
        return [
            self.ev("response.output_audio.done", **where),
            self.ev("response.output_audio_transcript.done", transcript=text, **where),
            self.ev("response.content_part.done", part={"type": "audio", "transcript": text}, **where),
            self.ev("response.output_item.done", response_id=rid, output_index=0, item=message),
            self.ev("response.done", response={"id": rid, "object": "realtime.response", "status": status,
                                               "status_details": details, "output": [message] + r["items"],
                                               "output_modalities": ["audio"]}),
        ]

    def cancel(self) -> list[dict]:
        """response.cancel: close the open response as cancelled and fence the rest of this agent turn."""
        if self.response is None:
            return []
        self.fenced = True
        return self.close("cancelled", "client_cancelled")

    # -- one frame
    def frame(self, out) -> list[dict]:
        """`out` is a server.FrameOutputs."""
        events: list[dict] = []
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
            where = dict(response_id=r["id"], item_id=r["item"], output_index=0, content_index=0)
            # `frame` (an extension) is the model frame of this packet: clients can check order and gaps
            events.append(self.ev("response.output_audio.delta", delta=base64.b64encode(out.pcm16).decode(),
                                  frame=out.frame, **where))
            if out.text_delta:
                r["transcript"] += out.text_delta
                events.append(self.ev("response.output_audio_transcript.delta", delta=out.text_delta, **where))
        events += self._user(out)
        events += self._tools(out)
        if out.turn_end and not self.fenced:
            events += self.close()
        return events

    def _user(self, out) -> list[dict]:
        if not out.user_delta:
            return []
        events = []
        if self.user_item is None:
            self.user_item, self.user_text = self.ids.next("item"), ""
            events.append(self.ev("conversation.item.added", previous_item_id=self.previous_user_item,
                                  item={"id": self.user_item, "object": "realtime.item", "type": "message",
                                        "role": "user", "status": "in_progress",
                                        "content": [{"type": "input_audio", "transcript": None}]}))
        self.user_text += out.user_delta
        events.append(self.ev("conversation.item.input_audio_transcription.delta", item_id=self.user_item,
                              content_index=0, delta=out.user_delta))
        return events

    def commit(self) -> list[dict]:
        """input_audio_buffer.commit: close the user item so far (its transcript is complete)."""
        item = self.user_item or self.ids.next("item")
        events = [self.ev("input_audio_buffer.committed", item_id=item, previous_item_id=self.previous_user_item),
                  self.ev("conversation.item.input_audio_transcription.completed", item_id=item, content_index=0,
                          transcript=self.user_text)]
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
                self.ev("response.function_call_arguments.delta", call_id=call.call_id, delta=call.arguments,
                        **where),
                self.ev("response.function_call_arguments.done", call_id=call.call_id, name=call.name,
                        arguments=call.arguments, **where),
                self.ev("response.output_item.done", response_id=r["id"], output_index=idx, item=done),
            ]
        for message in out.tool_errors:
            events.append(error_event(self.ids.next("event"), "function_call_parse_error", message))
        return events
