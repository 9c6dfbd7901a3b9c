"""The OpenAI wire format, without the web framework: request bodies parsed and validated into token ids and
`SamplingParams` (every bad field is an `APIError` naming it, OpenAI-style), engine failures mapped to errors,
and the response, stream-chunk, usage and llama-server `timings` dicts built."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from turbospec.errors import TurboSpecError
from turbospec.sampling import FLOAT32_MAX, MAX_LOGPROBS, SamplingParams, TokenLogprob

DEFAULT_MAX_BODY = 1 << 20  # 1 MiB
BODY_BYTES_PER_TOKEN = 16  # a context position's share of the default body limit: a prompt as long as the context
# fits as token ids ("151643, ": 8 bytes) or as text, escaped non-ASCII text included (about 9 bytes a token)
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters per stop string: stop matching stays cheap
SSE_DONE = b"data: [DONE]\n\n"


def body_limit(ctx: int) -> int:
    """The default largest request body for a server of `ctx` positions: room for a prompt that fills it."""
    return max(DEFAULT_MAX_BODY, BODY_BYTES_PER_TOKEN * ctx)


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
    try:  # ValueError: also a number past Python's 4300-digit limit, and NaN / Infinity (not JSON)
        body = json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError) as e:
        raise bad(f"request body is not valid JSON: {str(e)[:200]}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object", None, "invalid_type")
    _check_unicode(body)
    return body


def _not_json(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _check_unicode(body: dict) -> None:
    """Every string of the body, field names included, must be Unicode text: a JSON escape such as \\ud800
    decodes to a lone surrogate, which no tokenizer, stop matcher or UTF-8 response can carry."""
    for key, value in body.items():
        if not _encodable(key):
            raise bad("a field name is not valid Unicode (lone surrogate escape)", None)
        todo = [value]
        while todo:
            v = todo.pop()
            if isinstance(v, str):
                ok = _encodable(v)
            elif isinstance(v, list):
                todo += v
                continue
            elif isinstance(v, dict):
                todo += v.keys()
                todo += v.values()
                continue
            else:
                continue
            if not ok:
                raise bad(f"'{key}' holds text that is not valid Unicode (lone surrogate escape)", key)


def _encodable(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# ---- which fields each endpoint takes ------------------------------------------------------------------------
# Every field a request may carry; any other name is a 400 unknown_parameter, so that nothing a client asks for
# is silently ignored. `user`, `metadata` and `store` (false) are accepted by design: they do not change the
# output. The llama.cpp extensions are the ones llama-server documents under the same names.
COMMON_FIELDS = frozenset({
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "best_of", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", "metadata", "store",
    "top_k", "min_p", "repeat_penalty", "repeat_last_n", "ignore_eos", "n_predict", "cache_prompt",  # llama.cpp
})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                               "tool_choice", "parallel_tool_calls"}


def check_fields(body: dict, chat: bool) -> None:
    """Refuse a field the endpoint does not implement (unknown_parameter), and the accepted-by-design fields in
    a form the server cannot honour (`store: true`, a `response_format` other than text, a `suffix`)."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name not in known:
            where = "/v1/chat/completions" if chat else "/v1/completions"
            raise bad(f"unknown parameter '{name[:100]}' for {where}", name[:100], "unknown_parameter")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("'user' must be a string", "user", "invalid_type")
    meta = body.get("metadata")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise bad("'metadata' must be an object of strings", "metadata", "invalid_type")
    if flag(body, "store"):
        raise bad("this server does not store completions ('store' must be false)", "store", "unsupported_value")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
        for name in so:
            if name != "include_usage":
                raise bad(f"unknown parameter 'stream_options.{name[:100]}'", f"stream_options.{name[:100]}",
                          "unknown_parameter")
        if so.get("include_usage") is not None and not isinstance(so["include_usage"], bool):
            raise bad("'stream_options.include_usage' must be a boolean", "stream_options.include_usage",
                      "invalid_type")
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise bad("'response_format' must be an object", "response_format", "invalid_type")
        if fmt != {"type": "text"}:
            raise bad("only response_format {\"type\": \"text\"} is supported (no JSON mode or schema)",
                      "response_format", "unsupported_value")
    suffix = body.get("suffix")
    if suffix is not None:
        if not isinstance(suffix, str):
            raise bad("'suffix' must be a string", "suffix", "invalid_type")
        if suffix:
            raise bad("'suffix' (fill-in-the-middle) is not supported", "suffix", "unsupported_value")


def check_common(body: dict, model_name: str, chat: bool) -> None:
    """The checks before the prompt is read: every field known to the endpoint (`check_fields`), and those both
    endpoints share and this server only accepts one way: model, n, best_of."""
    check_fields(body, chat)
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
            raise bad(f"'{name}' must be an integer, got {_show(v)}", name, "invalid_type")
        v = int(v)
    if not integer:
        try:
            v = float(v)  # an integer too large for a float is out of every range
        except OverflowError:
            raise bad(f"'{name}' is out of range, got {_show(v)}", name) from None
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(f"'{name}' must be finite, got {v!r}", name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {_show(v)}", name)
    if hi is not None and v > hi:
        raise bad(f"'{name}' must be <= {hi}, got {_show(v)}", name)
    return v


def _show(v) -> str:
    """A number for an error message, cut short (a JSON integer can have thousands of digits)."""
    r = repr(v)
    return r if len(r) <= 40 else f"{r[:20]}...({len(r)} digits)"


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
    if any(len(s) > MAX_STOP_LENGTH for s in v):
        raise bad(f"a stop string may be at most {MAX_STOP_LENGTH} characters long", "stop")
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


def _string(v: Any, param: str, what: str = "a non-empty string") -> str:
    """A required non-empty string field."""
    if v is None:
        raise bad(f"'{param}' is required", param, "missing_required_parameter")
    if not isinstance(v, str) or not v:
        raise bad(f"'{param}' must be {what}", param, "invalid_type")
    return v


def _json_object(v: Any, param: str) -> dict:
    """A tool call's arguments: a JSON object, sent as its JSON text (OpenAI) or as the object itself."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except (ValueError, RecursionError):
            raise bad(f"'{param}' is not valid JSON", param) from None
    if not isinstance(v, dict):
        raise bad(f"'{param}' must be a JSON object", param, "invalid_type")
    return v


def _tool_calls(calls: Any, p: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as chat templates expect them: the arguments as a dict."""
    if not isinstance(calls, list):
        raise bad(f"'{p}.tool_calls' must be a list", f"{p}.tool_calls", "invalid_type")
    out = []
    for j, c in enumerate(calls):
        q = f"{p}.tool_calls[{j}]"
        if not isinstance(c, dict):
            raise bad(f"'{q}' must be an object", q, "invalid_type")
        if c.get("type", "function") != "function":
            raise bad(f"'{q}.type' must be 'function'", f"{q}.type", "unsupported_value")
        f = c.get("function")
        if not isinstance(f, dict):
            raise bad(f"'{q}.function' must be an object", f"{q}.function", "invalid_type")
        call: dict[str, Any] = {"type": "function", "function": {
            "name": _string(f.get("name"), f"{q}.function.name"),
            "arguments": _json_object(f.get("arguments"), f"{q}.function.arguments"),
        }}
        if c.get("id") is not None:
            call["id"] = _string(c["id"], f"{q}.id")
        out.append(call)
    return out


def parse_messages(body: dict, tools_ok: bool = True) -> list[dict[str, Any]]:
    """'messages' as the dicts a chat template expects: role and content (flattened to text; only an assistant
    message with tool calls may leave it out), an assistant's `tool_calls` (arguments as a dict; refused when
    not `tools_ok`, the template having no tool support), a tool message's `tool_call_id`, and `name`."""
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{p} must be an object", p, "invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad(f"{p}.role must be a non-empty string", f"{p}.role", "invalid_type")
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise bad(f"{p}.tool_calls: only assistant messages carry tool calls", f"{p}.tool_calls")
        if m.get("content") is None and not (role == "assistant" and calls):
            raise bad(f"{p}.content is required" + (" (or tool_calls)" if role == "assistant" else ""),
                      f"{p}.content", "missing_required_parameter")
        msg: dict[str, Any] = {"role": role, "content": _message_text(m.get("content"), i)}
        if calls:
            if not tools_ok:
                raise bad("this model's chat template does not support tool calls", f"{p}.tool_calls",
                          "unsupported_value")
            msg["tool_calls"] = _tool_calls(calls, p)
        if role == "tool":
            msg["tool_call_id"] = _string(m.get("tool_call_id"), f"{p}.tool_call_id")
        if m.get("name") is not None:
            msg["name"] = _string(m["name"], f"{p}.name")
        out.append(msg)
    return out


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's function tools (validated, as sent; None when it has none) and whether its output is
    parsed for tool calls (tools given and `tool_choice` not "none")."""

    tools: list[dict[str, Any]] | None
    parse_calls: bool


def parse_tools(body: dict) -> ToolRequest:
    """'tools' (OpenAI function tools), 'tool_choice' ("auto" or "none"; "required" and a named function are
    not supported) and 'parallel_tool_calls' (a boolean; the model may emit several calls either way)."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("'tools' must be a list of function tools", "tools", "invalid_type")
        names: set[str] = set()
        for i, t in enumerate(tools):
            p = f"tools[{i}]"
            if not isinstance(t, dict):
                raise bad(f"'{p}' must be an object", p, "invalid_type")
            if t.get("type") != "function":
                raise bad(f"'{p}.type' must be 'function'", f"{p}.type", "unsupported_value")
            f = t.get("function")
            if not isinstance(f, dict):
                raise bad(f"'{p}.function' must be an object", f"{p}.function", "invalid_type")
            name = f.get("name")
            if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
                raise bad(f"'{p}.function.name' must be 1-64 letters, digits, '_' or '-'", f"{p}.function.name")
            if name in names:
                raise bad(f"two tools are named '{name}'", f"{p}.function.name")
            names.add(name)
            for key, kind, ok in (("description", "a string", str), ("parameters", "an object (JSON Schema)", dict),
                                  ("strict", "a boolean", bool)):
                if f.get(key) is not None and not isinstance(f[key], ok):
                    raise bad(f"'{p}.function.{key}' must be {kind}", f"{p}.function.{key}", "invalid_type")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) or choice == "required":
        raise bad("only tool_choice 'auto' and 'none' are supported", "tool_choice", "unsupported_value")
    if choice is not None and choice not in ("auto", "none"):
        raise bad("'tool_choice' must be 'auto' or 'none'", "tool_choice",
                  "invalid_value" if isinstance(choice, str) else "invalid_type")
    flag(body, "parallel_tool_calls")
    return ToolRequest(tools or None, bool(tools) and choice != "none")


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
            tools = parse_tools(body).tools
            if tools and not tokenizer.supports_tools:
                raise bad("this model's chat template does not support tools", "tools", "unsupported_value")
            text = tokenizer.render_chat(parse_messages(body, tokenizer.supports_tools), tools=tools)
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
    """How many tokens to generate: the request's max_completion_tokens (chat), else max_tokens, else n_predict
    (llama.cpp; -1 = no limit), clamped to the server's cap -n (`defaults.max_tokens`; 0 = no cap), which is
    also the default, itself capped at the room left in the context. More than the room is a 400."""
    room = ctx - n_prompt
    if room < 1:
        raise bad(f"prompt is {n_prompt} tokens; the context holds {ctx} (no room to generate)",
                  prompt_param(chat), "context_length_exceeded")
    cap = defaults.max_tokens if defaults.max_tokens > 0 else None
    asked = {name: number(body, name, integer=True)
             for name in (("max_completion_tokens",) if chat else ()) + ("max_tokens", "n_predict")}
    if asked["n_predict"] == -1:
        asked["n_predict"] = None  # llama.cpp's "no limit": up to the cap and the context
    param, mt = next(((k, v) for k, v in asked.items() if v is not None), ("max_tokens", None))
    for k, v in asked.items():
        if v == 0 and k == "max_tokens" and echo(body, chat):
            continue  # the prompt's logprobs only, no output: log-likelihood evaluation (lm-eval-harness)
        if v is not None and v <= 0:
            raise bad(f"'{k}' must be >= 1{' (or -1)' if k == 'n_predict' else ''}, got {_show(v)}", k)
    if mt is None:
        return min(cap, room) if cap is not None else room
    if cap is not None:
        mt = min(mt, cap)  # the server's -n: asked for more, the reply ends with finish_reason "length"
    if mt > room:
        raise bad(f"prompt ({n_prompt} tokens) + {param} ({_show(mt)}) exceeds the context size {ctx}", param,
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
            repeat_penalty=_pick(body, "repeat_penalty", d.repeat_penalty, lo=0, lo_open=True, hi=FLOAT32_MAX),
            repeat_last_n=min(_pick(body, "repeat_last_n", d.repeat_last_n, lo=-1, integer=True), ctx),
            seed=_pick(body, "seed", d.seed, integer=True, lo=-(2**63), hi=2**64 - 1),
            max_tokens=mt,
            stop=stop_strings(body) if "stop" in body else list(d.stop),
            ignore_eos=flag(body, "ignore_eos") or d.ignore_eos,
            cache_prompt=body.get("cache_prompt") is None or flag(body, "cache_prompt"),
        )
    except ValueError as e:
        raise bad(str(e)) from None


# ---- logprobs, logit_bias, echo ----------------------------------------------------------------------------
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
MIN_LOGPROB = -9999.0  # written instead of -inf (JSON has no infinity), as vLLM does


def logprobs_count(body: dict, chat: bool) -> int | None:
    """How many alternatives per token the request wants with the logprobs; None: no logprobs. Completions:
    `logprobs` an integer 0..20. Chat: `logprobs` a boolean and `top_logprobs` 0..20 (only with logprobs)."""
    if not chat:
        return number(body, "logprobs", lo=0, hi=MAX_LOGPROBS, integer=True)
    on = flag(body, "logprobs")
    top = number(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS, integer=True)
    if top is not None and not on:
        raise bad("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


def echo(body: dict, chat: bool) -> bool:
    """`echo` (completions only): the reply starts with the prompt."""
    return not chat and flag(body, "echo")


def logit_bias(body: dict, vocab: int) -> dict[int, float]:
    """`logit_bias`: OpenAI's object mapping token ids (strings of digits) to biases in [-100, 100]."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad("'logit_bias' must be an object mapping token ids to biases", "logit_bias", "invalid_type")
    out: dict[int, float] = {}
    for key, b in v.items():
        if not re.fullmatch(r"[0-9]{1,12}", key):
            raise bad(f"'logit_bias' keys must be token ids, got {key[:40]!r}", "logit_bias")
        tok = int(key)
        if tok >= vocab:
            raise bad(f"'logit_bias' token id {tok} is outside the vocabulary [0, {vocab})", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise bad(f"'logit_bias' values must be numbers, got {type(b).__name__} for {tok}", "logit_bias",
                      "invalid_type")
        if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise bad(f"'logit_bias' values must lie in [-100, 100], got {_show(b)} for {tok}", "logit_bias")
        out[tok] = float(b)
    return out


def with_logprobs_and_bias(params: SamplingParams, body: dict, chat: bool, vocab: int) -> SamplingParams:
    """`params` with the request's logprobs, logit_bias and, for echo with logprobs, prompt logprobs."""
    k = logprobs_count(body, chat)
    return dataclasses.replace(params, logprobs=k, logit_bias=logit_bias(body, vocab),
                               prompt_logprobs=k if k is not None and echo(body, chat) else None)


def echo_text(body: dict, tokenizer, tokens: list[int]) -> str:
    """The prompt as an echoing reply starts: the text sent, or the token ids sent, decoded."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str):
        return p
    return tokenizer.decode(tokens) if tokenizer is not None else ""


class LogprobWriter:
    """The engine's `TokenLogprob`s of one request in OpenAI's wire format. Completions: `{tokens,
    token_logprobs, top_logprobs, text_offset}`, where top_logprobs maps token text to logprob for the k most
    probable tokens and the chosen one, and text_offset counts the characters of the token texts before each
    token (the echoed prompt's included). Chat: `{content: [{token, logprob, bytes, top_logprobs: [{token,
    logprob, bytes}]}]}`. A token's text is its id decoded alone (`token_id:N` without a tokenizer); `add` the
    entries of each engine chunk, `pop` them formatted (per stream chunk, or once for the whole reply)."""

    def __init__(self, tokenizer, chat: bool, prompt: list[int]):
        self.tokenizer = tokenizer
        self.chat = chat
        self.prompt = prompt
        self.offset = 0
        self.ids: list[int] = []
        self.entries: list[TokenLogprob | None] = []
        self._texts: dict[int, str] = {}

    def add(self, logprobs: list[TokenLogprob] | None, prompt_logprobs: list[TokenLogprob | None] | None) -> None:
        if prompt_logprobs is not None:  # the first prompt token has no logprob (None)
            self.ids += self.prompt
            self.entries += prompt_logprobs
        if logprobs:
            self.ids += [e.token for e in logprobs]
            self.entries += logprobs

    @property
    def pending(self) -> bool:
        return bool(self.ids)

    def pop(self) -> dict:
        ids, entries = self.ids, self.entries
        self.ids, self.entries = [], []
        if self.chat:
            return {"content": [{**self._entry(e.token, e.logprob), "top_logprobs": [self._entry(t, lp)
                                                                                   for t, lp in e.top]}
                                for e in entries if e is not None]}
        texts = [self.text(t) for t in ids]
        offsets = []
        for t in texts:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": texts, "token_logprobs": [None if e is None else _logprob(e.logprob) for e in entries],
                "top_logprobs": [None if e is None else self._top(e) for e in entries], "text_offset": offsets}

    def text(self, token: int) -> str:
        s = self._texts.get(token)
        if s is None:
            s = self.tokenizer.decode([token], False) if self.tokenizer is not None else f"token_id:{token}"
            self._texts[token] = s
        return s

    def _entry(self, token: int, logprob: float) -> dict:
        s = self.text(token)
        return {"token": s, "logprob": _logprob(logprob), "bytes": list(s.encode("utf-8"))}

    def _top(self, e: TokenLogprob) -> dict[str, float]:
        top: dict[str, float] = {}
        for t, lp in (*e.top, (e.token, e.logprob)):
            top.setdefault(self.text(t), _logprob(lp))  # tokens with the same text: the most probable
        return top


def _logprob(x: float) -> float:
    return max(x, MIN_LOGPROB)


# ---- responses ---------------------------------------------------------------------------------------------
def timings(stats) -> dict:
    """llama-server-style timings."""
    if stats is None:
        return {}
    gen_s = max(stats.ttft_s - stats.prefill_s, 0.0) + stats.decode_s
    spec = stats.spec
    computed = stats.prompt_tokens - stats.cached_tokens
    return {  # as llama-server: prompt_n counts the prompt tokens computed, cache_n those reused from the cache
        "cache_n": stats.cached_tokens,
        "prompt_n": computed,
        "prompt_ms": stats.prefill_s * 1e3,
        "prompt_per_token_ms": stats.prefill_s * 1e3 / computed if computed else 0.0,
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

    def completion(self, text: str, reason: str, usage: dict, timings: dict, logprobs: dict | None = None) -> dict:
        """The non-streamed response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
        body = self._head("chat.completion" if self.chat else "text_completion")
        body.update(choices=[choice], usage=usage, timings=timings)
        return body

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, delta: str | None, reason: str | None = None, role: bool = False, logprobs: dict | None = None,
              **extra) -> dict:
        """A stream chunk: a text delta (chat: the role first, then content) with the logprobs of its tokens,
        or the finish reason."""
        if self.chat:
            d: dict = {}
            if role:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            choice = {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": reason}
        msg = self._head(self.chunk_object)
        msg["choices"] = [choice]
        msg.update(extra)
        return msg

    def usage_chunk(self, usage: dict) -> dict:
        """The stream's last chunk when the client asked for usage."""
        msg = self._head(self.chunk_object)
        msg.update(choices=[], usage=usage)
        return msg
