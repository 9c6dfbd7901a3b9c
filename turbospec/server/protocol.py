"""The OpenAI wire format, without the web framework: request bodies parsed and validated into token ids and
`SamplingParams` (every bad field is an `APIError` naming it, OpenAI-style), engine failures mapped to errors,
and the response, stream-chunk, usage and llama-server `timings` dicts built."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from turbospec.errors import TurboSpecError
from turbospec.sampling import SamplingParams

DEFAULT_MAX_BODY = 1 << 20  # 1 MiB
MAX_STOP_STRINGS = 16
SSE_DONE = b"data: [DONE]\n\n"


# ---- errors ------------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error returned to the client as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad(msg: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, msg, param=param, code=code)


def engine_error(e: Exception) -> APIError:
    """What the client sees of an exception raised while generating: bad input is a 400, anything else a 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, (TurboSpecError, ValueError)):
        return APIError(400, str(e), "invalid_request_error", None, None)
    return APIError(500, f"generation failed: {type(e).__name__}: {e}", "server_error", None, None)


# ---- the body ----------------------------------------------------------------------------------------------
def check_content_length(header: str | None, limit: int) -> None:
    """Refuse a declared body size over `limit` before reading the body."""
    if header is None:
        return
    try:
        n = int(header)
    except ValueError:
        raise bad("invalid Content-Length header", None, "invalid_request") from None
    if n > limit:
        raise APIError(413, f"request body too large ({n} > {limit} bytes)", code="request_too_large")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"request body too large (> {limit} bytes)", code="request_too_large")


def parse_body(data: bytes) -> dict:
    """The request body as a JSON object."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"request body is not valid UTF-8 ({e.reason} at byte {e.start})", None,
                  "invalid_utf8") from None
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise bad(f"request body is not valid JSON: {str(e)[:200]}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object", None, "invalid_type")
    return body


def check_common(body: dict, model_name: str) -> None:
    """The fields both endpoints share and this server only accepts one way: model, n, best_of,
    stream_options."""
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise bad("'model' must be a string", "model", "invalid_type")
        if model != model_name:
            raise APIError(404, f"model '{model[:100]}' not found; this server serves '{model_name}'",
                           "not_found_error", "model", "model_not_found")
    for name in ("n", "best_of"):
        v = number(body, name, integer=True)
        if v is not None and v != 1:
            raise bad(f"only {name}=1 is supported", name, "unsupported_value")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad("'stream_options' must be an object", "stream_options", "invalid_type")


def include_usage(body: dict, stream: bool) -> bool:
    """Whether the response carries usage: always when not streaming, on request when streaming."""
    so = body.get("stream_options") or {}
    return bool(so.get("include_usage")) if stream else True


# ---- fields ------------------------------------------------------------------------------------------------
def number(body: dict, name: str, lo: float | None = None, hi: float | None = None, integer: bool = False,
           lo_open: bool = False):
    """A numeric field (None if absent / null); rejects bools, strings, NaN/inf and out-of-range values."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'}, got {type(v).__name__}",
                  name, "invalid_type")
    if integer and not isinstance(v, int):
        if not (isinstance(v, float) and v.is_integer()):
            raise bad(f"'{name}' must be an integer, got {v!r}", name, "invalid_type")
        v = int(v)
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(f"'{name}' must be finite, got {v!r}", name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v!r}", name)
    if hi is not None and v > hi:
        raise bad(f"'{name}' must be <= {hi}, got {v!r}", name)
    return v


def flag(body: dict, name: str) -> bool:
    """A boolean field (False if absent / null)."""
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean", name, "invalid_type")
    return v


def stop_strings(body: dict) -> list[str]:
    """'stop': a string or a list of strings; empty strings dropped."""
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(v) > MAX_STOP_STRINGS:
        raise bad(f"'stop' may hold at most {MAX_STOP_STRINGS} strings", "stop")
    return [s for s in v if s]


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            ok = isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            if not ok:
                raise bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content",
                          "invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content",
              "invalid_type")


def parse_messages(body: dict) -> list[dict[str, str]]:
    """'messages' as [{"role", "content"}] with the content flattened to text."""
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad(f"messages[{i}].role must be a non-empty string", f"messages[{i}].role",
                      "invalid_type")
        out.append({"role": role, "content": _message_text(m.get("content"), i)})
    return out


def parse_prompt(body: dict, vocab: int) -> str | list[int]:
    """'prompt': a string, a list of token ids, or a one-element list of either."""
    p = body.get("prompt")
    if p is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one prompt
    if isinstance(p, str):
        if not p:
            raise bad("'prompt' must not be empty", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if any(t < 0 or t >= vocab for t in p):
            raise bad(f"prompt token ids must lie in [0, {vocab})", "prompt")
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad("only one prompt per request is supported", "prompt", "unsupported_value")
    raise bad("'prompt' must be a string or a non-empty list of token ids", "prompt", "invalid_type")


def prompt_param(chat: bool) -> str:
    """The field a prompt error names."""
    return "messages" if chat else "prompt"


def prompt_tokens(body: dict, tokenizer, vocab: int, chat: bool) -> list[int]:
    """The request's prompt as token ids: the chat template rendered, a text encoded, or token ids as sent."""
    if tokenizer is None:
        if chat:
            raise bad("this model has no tokenizer; chat is unavailable", "messages", "unsupported_value")
        p = parse_prompt(body, vocab)
        if isinstance(p, str):
            raise bad("this model has no tokenizer; send token ids", "prompt", "unsupported_value")
        return p
    param = prompt_param(chat)
    try:
        if chat:
            text = tokenizer.render_chat(parse_messages(body))
        else:
            p = parse_prompt(body, vocab)
            if isinstance(p, list):
                return p
            text = p
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise bad("the text is not valid Unicode (lone surrogate escape)", param) from None
        return tokenizer.encode(text, add_special=not chat)
    except TurboSpecError as e:
        raise bad(str(e), param) from None


# ---- sampling ----------------------------------------------------------------------------------------------
def max_tokens(body: dict, defaults: SamplingParams, ctx: int, n_prompt: int, chat: bool) -> int:
    """max_tokens (chat: max_completion_tokens first); default -n capped at the room left in the context."""
    room = ctx - n_prompt
    if room < 1:
        raise bad(f"prompt is {n_prompt} tokens; the context holds {ctx} (no room to generate)",
                  prompt_param(chat), "context_length_exceeded")
    mt = number(body, "max_completion_tokens", integer=True) if chat else None
    if mt is None:
        mt = number(body, "max_tokens", integer=True)
    param = "max_tokens"
    if mt is None:
        mt = min(defaults.max_tokens, room) if defaults.max_tokens > 0 else room
    if mt <= 0:
        raise bad(f"'{param}' must be >= 1, got {mt}", param)
    if mt > room:
        raise bad(f"prompt ({n_prompt} tokens) + max_tokens ({mt}) exceeds the context size {ctx}", param,
                  "context_length_exceeded")
    return mt


def _pick(body: dict, name: str, default, **kw):
    v = number(body, name, **kw)
    return default if v is None else v


def sampling_params(body: dict, defaults: SamplingParams, ctx: int, n_prompt: int, chat: bool) -> SamplingParams:
    """The request's sampling settings; fields it leaves out come from the server's defaults."""
    d = defaults
    mt = max_tokens(body, d, ctx, n_prompt, chat)
    try:
        return SamplingParams(
            temperature=_pick(body, "temperature", d.temperature, lo=0, hi=2),
            top_p=_pick(body, "top_p", d.top_p, lo=0, hi=1, lo_open=True),
            top_k=_pick(body, "top_k", d.top_k, lo=0, integer=True),
            min_p=_pick(body, "min_p", d.min_p, lo=0, hi=1),
            presence_penalty=_pick(body, "presence_penalty", d.presence_penalty, lo=-2, hi=2),
            frequency_penalty=_pick(body, "frequency_penalty", d.frequency_penalty, lo=-2, hi=2),
            repeat_penalty=_pick(body, "repeat_penalty", d.repeat_penalty, lo=0, lo_open=True),
            repeat_last_n=d.repeat_last_n,
            seed=_pick(body, "seed", d.seed, integer=True, lo=-(2**63), hi=2**64 - 1),
            max_tokens=mt,
            stop=stop_strings(body) if "stop" in body else list(d.stop),
            ignore_eos=flag(body, "ignore_eos") or d.ignore_eos,
        )
    except ValueError as e:
        raise bad(str(e)) from None


# ---- responses ---------------------------------------------------------------------------------------------
def timings(stats) -> dict:
    """llama-server-style timings."""
    if stats is None:
        return {}
    gen_s = max(stats.ttft_s - stats.prefill_s, 0.0) + stats.decode_s
    spec = stats.spec
    return {
        "prompt_n": stats.prompt_tokens,
        "prompt_ms": stats.prefill_s * 1e3,
        "prompt_per_token_ms": stats.prefill_s * 1e3 / stats.prompt_tokens if stats.prompt_tokens else 0.0,
        "prompt_per_second": stats.prefill_tps,
        "predicted_n": stats.gen_tokens,
        "predicted_ms": gen_s * 1e3,
        "predicted_per_token_ms": gen_s * 1e3 / stats.gen_tokens if stats.gen_tokens else 0.0,
        "predicted_per_second": stats.gen_tokens / gen_s if gen_s > 0 else 0.0,
        "draft_n": spec.draft_tokens if spec is not None else 0,
        "draft_n_accepted": spec.accepted if spec is not None else 0,
    }


def usage(stats, n_prompt: int, n_gen: int) -> dict:
    """Token counts: the engine's when it finished, else what the server counted."""
    if stats is not None:
        n_prompt, n_gen = stats.prompt_tokens, stats.gen_tokens
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


def sse(msg: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(msg).encode() + b"\n\n"


@dataclass(frozen=True)
class Reply:
    """What every response (or stream chunk) to one request repeats: its id, creation time, model, and
    whether it is a chat completion or a text completion."""

    id: str
    created: int
    model: str
    chat: bool

    @classmethod
    def new(cls, model: str, chat: bool) -> Reply:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        return cls(rid, int(time.time()), model, chat)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def completion(self, text: str, reason: str, usage: dict, timings: dict) -> dict:
        """The non-streamed response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        body = self._head("chat.completion" if self.chat else "text_completion")
        body.update(choices=[choice], usage=usage, timings=timings)
        return body

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, delta: str | None, reason: str | None = None, role: bool = False, **extra) -> dict:
        """A stream chunk: a text delta (chat: the role first, then content), or the finish reason."""
        if self.chat:
            d: dict = {}
            if role:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
        msg = self._head(self.chunk_object)
        msg["choices"] = [choice]
        msg.update(extra)
        return msg

    def usage_chunk(self, usage: dict) -> dict:
        """The stream's last chunk when the client asked for usage."""
        msg = self._head(self.chunk_object)
        msg.update(choices=[], usage=usage)
        return msg
