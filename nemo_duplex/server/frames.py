"""What a frame says, decoded per call: the agent's text by turn, the user transcript (RNN-T), and the tool
calls on the function channel. `FrameDecoder` turns the engine's FrameEvents, in order, into FrameOutputs
that both protocols render."""
from __future__ import annotations

from dataclasses import dataclass, field

from nemo_duplex.server.realtime_protocol import EventIds
from nemo_duplex.server.tools import parse_tool_calls
from nemo_duplex.serving.calls import FrameEvent


@dataclass
class ToolCall:
    call_id: str
    item_id: str
    name: str
    arguments: str      # JSON text
    frame: int          # frame on which <SPECIAL_21> closed the call


@dataclass
class FrameOutputs:
    frame: int
    pcm16: bytes                 # the frame's audio in the caller's format (the model's: 1764 PCM16 samples at 22.05 kHz)
    text_delta: str              # new agent text (display decoding drops specials, spec 3.8)
    turn_start: bool             # BOS on the text channel
    turn_end: bool               # EOS on the text channel
    user_delta: str              # new RNN-T user transcript text
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    lag_s: float = 0.0           # engine: last input sample of the frame -> frame handed out
    user_active: bool = False    # the RNN-T gave tokens this frame (the user is speaking)
    text_token: int = 0          # 1 when the agent's text channel carried a token other than PAD/BOS/EOS


class IncrementalText:
    """Decode a growing token list and hand out only the new text. Byte-level BPE can split a
    character over tokens, so a decode ending in U+FFFD waits for the next token. Past `fold` ids the
    list is cut back to its last `keep` (decoding context for the next token), so a long turn costs
    O(1) per frame. fold 32, not 256: the decodes run on the event loop for every call's every frame, and
    with 256 the text and transcript of one frame cost ~100 us (random weights emit a token every frame
    and the RNN-T ten; ~13 ms of loop time per 80 ms at 128 calls), with 32 ~30 us (this machine's CPU)."""

    def __init__(self, decode, fold: int = 32, keep: int = 8):
        self.decode, self.ids, self.sent = decode, [], ""
        self.fold, self.keep = fold, keep

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        if not text.startswith(self.sent):   # a merge changed earlier characters: resend from the split
            k = 0
            while k < min(len(text), len(self.sent)) and text[k] == self.sent[k]:
                k += 1
            self.sent = self.sent[:k]
        delta, self.sent = text[len(self.sent):], text
        if len(self.ids) > self.fold:
            self.ids = self.ids[-self.keep:]
            self.sent = self.decode(self.ids)
        return delta

    def reset(self) -> None:
        self.ids, self.sent = [], ""


class FrameDecoder:
    """Per call: FrameEvents in order -> FrameOutputs."""

    def __init__(self, tokenizer, rnnt_vocab, tokens, ids: EventIds, max_tool_call_tokens: int):
        self.tokens = tokens
        self.skip = tokenizer.display_skip_ids
        self.tool_start = tokenizer.token_to_id(tokens.tool_call_start)
        self.tool_end = tokenizer.token_to_id(tokens.tool_call_end)
        self.text = IncrementalText(tokenizer.decode)
        self.user = IncrementalText(rnnt_vocab.decode) if rnnt_vocab is not None else None
        self.tokenizer, self.ids, self.max_tool = tokenizer, ids, max_tool_call_tokens
        self.collecting: list[int] | None = None

    def __call__(self, ev: FrameEvent, audio=None) -> FrameOutputs:
        """`audio`: the call's audio.OutputStream (None: the model's own PCM16)."""
        t = self.tokens
        pcm = ev.pcm16 if audio is None or audio.native else audio(ev.pcm)
        out = FrameOutputs(ev.frame, pcm, "", ev.text == t.bos_id, ev.text == t.eos_id, "",
                           lag_s=max(0.0, ev.sent_at - ev.ready_at), user_active=bool(ev.user))
        if out.turn_start or out.turn_end:   # a turn's text is decoded on its own (LANDSCAPE 2.2/2.3)
            self.text.reset()
        elif ev.text not in self.skip:
            out.text_token = 1
            out.text_delta = self.text.add([ev.text])
        if self.user is not None and ev.user:
            out.user_delta = self.user.add(list(ev.user))
        self._function_channel(ev, out)
        return out

    def _function_channel(self, ev: FrameEvent, out: FrameOutputs) -> None:
        f = ev.func
        if f == self.tool_start and self.tool_start is not None:
            self.collecting = []
        elif self.collecting is None:
            return
        elif f == self.tool_end:
            ids, self.collecting = self.collecting, None
            text = self.tokenizer.decode(ids)
            try:
                for name, args in parse_tool_calls(text):
                    out.tool_calls.append(ToolCall(self.ids.next("call"), self.ids.next("item"), name, args,
                                                   ev.frame))
            except ValueError as e:
                out.tool_errors.append(f"could not parse the model's tool call ({e}): {text[:300]!r}")
        elif f not in self.skip:   # PAD between call tokens carries nothing
            self.collecting.append(f)
            if len(self.collecting) > self.max_tool:
                self.collecting = None
                out.tool_errors.append(f"tool call longer than serve.max_tool_call_tokens = {self.max_tool} "
                                       f"tokens; dropped")
