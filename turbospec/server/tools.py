"""Tool calls in the model's output, in the Qwen / Hermes format the chat templates ask for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolCallParser` is fed the text as it is generated and hands back, in order, content to send now and finished
`ToolCall`s: text outside the tags flows on at once, except a tail that may be the start of `<tool_call>`;
a call is held until its `</tool_call>`. A block whose inside is not a JSON object with a string `name` (and
an object `arguments`, or none) stays content, tags included, as does a block the output ends inside.
Whitespace just before a call, and at the end of an output that holds calls, is not content (so the content
of an output that is only calls is None, OpenAI's `content: null`); whitespace is therefore held until what
follows it is known. Feeding the text in any pieces gives the same content and calls as feeding it whole
(`split_tool_calls`).

The request side (validating `tools`, `tool_choice` and tool messages) lives in `protocol`."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from turbospec.server.protocol import Reply

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    index: int  # its place among the output's calls
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def to_dict(self) -> dict:
        """The call as it appears in a chat.completion message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self) -> dict:
        """The call as one entry of a stream chunk's `delta.tool_calls` (the whole call in one chunk)."""
        return {"index": self.index, **self.to_dict()}


def _partial_open(text: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `<tool_call>`."""
    for k in range(min(len(text), len(OPEN) - 1), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


def _parse_call(inner: str, index: int, new_id: Callable[[], str]) -> ToolCall | None:
    try:
        obj = json.loads(inner)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return ToolCall(index, new_id(), obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """Splits generated text, fed piece by piece, into content and tool calls (see the module docstring)."""

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self.new_id = new_id
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not yet handed back: a possible start of OPEN, or the inside of a call
        self._in_call = False
        self._scanned = 0  # inside a call: how far _buf is known to hold no CLOSE
        self._held: list[str] = []  # trailing whitespace of the content: sent with the next content, else dropped
        self._before = ""  # the whitespace held when the current call opened (content again if it is malformed)

    def feed(self, text: str) -> list[str | ToolCall]:
        """The content and the calls that `text` completes, in order."""
        out: list[str | ToolCall] = []
        self._buf += text
        while True:
            if not self._in_call:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = _partial_open(self._buf)
                    self._content(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._content(self._buf[:i], out)
                self._buf = self._buf[i + len(OPEN):]
                self._in_call, self._scanned = True, 0
                self._before, self._held = "".join(self._held), []
            j = self._buf.find(CLOSE, self._scanned)
            if j < 0:
                self._scanned = max(0, len(self._buf) - len(CLOSE) + 1)
                return out
            inner, self._buf, self._in_call = self._buf[:j], self._buf[j + len(CLOSE):], False
            call = _parse_call(inner, len(self.calls), self.new_id)
            if call is None:
                self._content(self._before + OPEN + inner + CLOSE, out)
            else:
                self.calls.append(call)
                out.append(call)

    def flush(self) -> list[str]:
        """The end of the output: what is still held, as content (an unfinished call stays text); trailing
        whitespace only when the output holds no calls."""
        out: list[str | ToolCall] = []
        rest = self._before + OPEN + self._buf if self._in_call else self._buf
        self._buf, self._in_call = "", False
        self._content(rest, out)
        if self._held and not self.calls:
            out.append("".join(self._held))
        self._held = []
        return [x for x in out if isinstance(x, str)]

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output at once: its content (None when the output holds calls and nothing else) and calls."""
        pieces = self.feed(text) + self.flush()
        content = "".join(x for x in pieces if isinstance(x, str))
        return (content or None) if self.calls else content, self.calls

    def _content(self, text: str, out: list[str | ToolCall]) -> None:
        """Hand back `text`, holding its trailing whitespace (whitespace before a call is not content)."""
        if not text:
            return
        if text.isspace():
            self._held.append(text)
            return
        body = text.rstrip()
        out.append("".join(self._held) + body)
        self._held = [text[len(body):]] if len(body) < len(text) else []


def split_tool_calls(text: str, new_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (None when it holds calls and nothing else) and tool calls."""
    return ToolCallParser(new_id).split(text)


def with_tool_calls(response: dict, content: str | None, calls: list[ToolCall]) -> dict:
    """A chat.completion response whose message carries `calls` (and `content`, which may be None)."""
    message = response["choices"][0]["message"]
    message["content"] = content
    message["tool_calls"] = [c.to_dict() for c in calls]
    return response


def piece_chunk(reply: Reply, piece: str | ToolCall) -> dict:
    """The chat.completion.chunk for one piece of parsed output: a content delta, or a whole tool call as
    `delta.tool_calls`."""
    if isinstance(piece, str):
        return reply.chunk(piece)
    chunk = reply.chunk(None)
    chunk["choices"][0]["delta"]["tool_calls"] = [piece.delta()]
    return chunk
