"""The model's tool protocol (spec 3.8-3.9): tools advertised in the system prompt, the model's calls read off
its function channel (`<TOOLCALL>[...]</TOOLCALL>`), and results forced back onto that channel as
`<TOOL_RESPONSE>[...]</TOOL_RESPONSE>` tokens."""
from __future__ import annotations

import json

from nemo_duplex.server.errors import Refusal


def parse_tool_calls(text: str) -> list[tuple[str, str]]:
    """`<TOOLCALL>[{"name": ..., "arguments": ...}, ...]</TOOLCALL>` -> [(name, arguments JSON)] (spec 3.9:
    arguments are an object or a JSON string). Raises ValueError with the reason."""
    text = text.strip()
    start, end = "<TOOLCALL>", "</TOOLCALL>"
    if not (text.startswith(start) and text.endswith(end)):
        raise ValueError(f"expected <TOOLCALL>[...]</TOOLCALL>, got {text[:200]!r}")
    value = json.loads(text[len(start):-len(end)])
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError("the tool call is not a non-empty JSON list")
    calls = []
    for c in value:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise ValueError(f"a tool call without a string name: {json.dumps(c)[:200]}")
        args = c.get("arguments", {})
        if isinstance(args, str):
            json.loads(args)  # must itself be JSON
        else:
            args = json.dumps(args, ensure_ascii=False)
        calls.append((c["name"], args))
    return calls


def render_tool_prompt(instructions: str | None, tools: list[dict]) -> str | None:
    """System prompt with the tools advertised (spec 3.9): instructions, the tool list in an
    <AVAILABLE_TOOLS> block (JSON with sorted keys, as the training template's tojson), how to call, and
    each tool's on-hold message. The on-hold message reaches the model only through this prompt: the
    model speaks on its text channel, so the server cannot put words in its mouth; it can only ask."""
    if not tools:
        return instructions
    listed = []
    for t in tools:
        entry = {"name": t["name"], "description": t.get("description", ""),
                 "parameters": t.get("parameters", {"type": "object", "properties": {}})}
        if t.get("on_hold_message"):
            entry["on_hold_message"] = t["on_hold_message"]
        listed.append(entry)
    parts = [instructions.strip()] if instructions else []
    parts.append("You can use the following tools to assist the user if required: <AVAILABLE_TOOLS>"
                 + json.dumps(listed, sort_keys=True, ensure_ascii=False) + "</AVAILABLE_TOOLS>")
    parts.append('To use a tool, write <TOOLCALL>[{"name": <tool name>, "arguments": <arguments object>}]'
                 "</TOOLCALL>. The result comes back as <TOOL_RESPONSE>[<result>]</TOOL_RESPONSE>.")
    holds = [f'While {t["name"]} runs, say: "{t["on_hold_message"]}"' for t in tools if t.get("on_hold_message")]
    if holds:
        parts.append(" ".join(holds))
    return " ".join(parts)


def tool_response_ids(tokenizer, output: str, limit: int) -> list[int]:
    """The tokens of `<TOOL_RESPONSE>[<json value>]</TOOL_RESPONSE>` (spec 3.9), forced one per frame on
    the function channel. `output` is used as JSON when it parses, else as a JSON string. A result that
    would tokenise to a special token (e.g. a literal "<SPECIAL_20>") is refused: it would be read as
    channel control."""
    try:
        value = json.loads(output)
    except ValueError:
        value = output
    text = "<TOOL_RESPONSE>[" + json.dumps(value, ensure_ascii=False) + "]</TOOL_RESPONSE>"
    ids = tokenizer.encode(text)
    if any(i in tokenizer.display_skip_ids for i in ids):
        raise Refusal("invalid_tool_output", "the tool output contains a special token string "
                      "(e.g. <s>, </s> or <SPECIAL_n>)")
    if len(ids) > limit:
        raise Refusal("tool_output_too_long", f"the tool output is {len(ids)} tokens; the limit is "
                      f"serve.max_tool_output_tokens = {limit}")
    return ids


def on_hold_message(settings, name: str) -> str | None:
    """The on-hold message the session's tool `name` declares (None: none)."""
    for t in settings.tools:
        if t.get("name") == name and isinstance(t.get("on_hold_message"), str) and t["on_hold_message"].strip():
            return t["on_hold_message"]
    return None
