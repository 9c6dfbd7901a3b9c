"""Tool calls (issue #24, item 3): `tools` rendered into the prompt by a chat template that supports them (as
transformers' apply_chat_template renders it) or refused; tool messages validated; the model's Qwen-style
`<tool_call>` output parsed into OpenAI `tool_calls`, streamed or not; and all of it through the server."""

import json
import threading
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospec.server.protocol import APIError, parse_messages, parse_tools
from turbospec.server.tools import ToolCall, ToolCallParser, split_tool_calls

# A reduced template with the structure of Qwen3's: tools as JSON lines in the system turn, assistant tool calls
# as <tool_call> JSON, tool results folded into a user turn as <tool_response>s.
QWEN_TOOLS_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>assistant\n' + content }}
{%- for tool_call in message.tool_calls or [] %}
{%- if (loop.first and content) or not loop.first %}{{- '\n' }}{%- endif %}
{%- set tool_call = tool_call.function if tool_call.function else tool_call %}
{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments if tool_call.arguments is string else tool_call.arguments | tojson }}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == "tool" %}
{%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & \"later\" in a city, e.g. Zürich",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12:00"}]},
]


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory):
    """A tokenizer directory (the demo byte tokenizer) whose chat template supports tools."""
    from turbospec.demo import byte_tokenizer

    d = tmp_path_factory.mktemp("tools")
    byte_tokenizer(d)
    (d / "chat_template.jinja").write_text(QWEN_TOOLS_TEMPLATE)
    return d


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    """The demo byte tokenizer with its own chat template, which has no tools."""
    from turbospec.demo import byte_tokenizer

    d = tmp_path_factory.mktemp("plain")
    byte_tokenizer(d)
    return d


def _tokenizer(d):
    from turbospec.tokenizer import Tokenizer

    return Tokenizer(d)


# ---- rendering ---------------------------------------------------------------------------------------------
def test_render_with_tools_matches_transformers(tool_dir, plain_dir):
    render_jinja_template = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    tk = _tokenizer(tool_dir)
    assert tk.supports_tools and not _tokenizer(plain_dir).supports_tools
    msgs = parse_messages({"messages": CONVERSATION})
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # a dict for the template
    assert msgs[2]["content"] == "" and msgs[4] == {"role": "tool", "content": "12:00", "tool_call_id": "call_2"}
    tools = [WEATHER, TIME]
    ours = tk.render_chat(msgs, tools=tools)
    ref, _ = render_jinja_template([msgs], tools=tools, chat_template=QWEN_TOOLS_TEMPLATE, add_generation_prompt=True)
    assert ours == ref[0]
    # tojson as transformers has it: keys in order, no HTML escapes, no \u escapes
    assert json.dumps(WEATHER, ensure_ascii=False) in ours and "Zürich" in ours and "<now> & " in ours
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in ours
    assert "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>" in ours
    # without tools the template takes its other branch
    plain = tk.render_chat(msgs[:2])
    assert "<tools>" not in plain and plain == render_jinja_template(
        [msgs[:2]], chat_template=QWEN_TOOLS_TEMPLATE, add_generation_prompt=True)[0][0]


def test_render_refuses_tools_without_template_support(plain_dir):
    from turbospec.errors import TurboSpecError

    with pytest.raises(TurboSpecError, match="does not support tools"):
        _tokenizer(plain_dir).render_chat([{"role": "user", "content": "hi"}], tools=[WEATHER])


# ---- request validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param, code", [
    ({"tools": {"a": 1}}, "tools", "invalid_type"),
    ({"tools": ["x"]}, "tools[0]", "invalid_type"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "unsupported_value"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "invalid_type"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters", "invalid_type"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "unsupported_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice", "unsupported_value"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_type"),
])
def test_bad_tools_fields(body, param, code):
    with pytest.raises(APIError) as e:
        parse_tools(body)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)


def test_tool_choice():
    assert parse_tools({}).tools is None and not parse_tools({}).parse_calls
    assert parse_tools({"tools": [WEATHER], "parallel_tool_calls": False}).parse_calls
    assert parse_tools({"tools": [WEATHER], "tool_choice": "auto"}).parse_calls
    none = parse_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert none.tools == [WEATHER] and not none.parse_calls  # still rendered, not parsed


@pytest.mark.parametrize("msg, param, code", [
    ({"role": "user"}, "messages[0].content", "missing_required_parameter"),
    ({"role": "system", "content": None}, "messages[0].content", "missing_required_parameter"),
    ({"role": "assistant"}, "messages[0].content", "missing_required_parameter"),
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id", "missing_required_parameter"),
    ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls", "invalid_value"),
    ({"role": "assistant", "tool_calls": "f()"}, "messages[0].tool_calls", "invalid_type"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]},
     "messages[0].tool_calls[0].function.arguments", "invalid_value"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}]},
     "messages[0].tool_calls[0].function.arguments", "invalid_type"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]},
     "messages[0].tool_calls[0].function.name", "missing_required_parameter"),
])
def test_bad_messages(msg, param, code):
    with pytest.raises(APIError) as e:
        parse_messages({"messages": [msg]})
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)


def test_tool_calls_in_messages_need_template_support():
    with pytest.raises(APIError) as e:
        parse_messages({"messages": CONVERSATION}, tools_ok=False)
    assert (e.value.param, e.value.code) == ("messages[2].tool_calls", "unsupported_value")


# ---- the output parser -------------------------------------------------------------------------------------
def _ids():
    n = iter(range(10**6))
    return lambda: f"call_{next(n)}"


def _streamed(pieces: list[str]) -> tuple[str, list[ToolCall]]:
    p = ToolCallParser(_ids())
    out: list = []
    for piece in pieces:
        out += p.feed(piece)
    out += p.flush()
    calls = [x for x in out if isinstance(x, ToolCall)]
    assert calls == p.calls
    return "".join(x for x in out if isinstance(x, str)), calls


def _calls(calls):
    return [(c.index, c.name, json.loads(c.arguments)) for c in calls]


def test_split_examples():
    content, calls = split_tool_calls("Let me check.\n" + CALL_TEXT)
    assert content == "Let me check."  # the whitespace before a call is not content
    assert _calls(calls) == [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert calls[0].to_dict() == {"id": calls[0].id, "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert split_tool_calls("\n" + CALL_TEXT + "\n\n")[0] is None  # only whitespace besides the calls
    assert split_tool_calls("Hello, no calls. a <tool b") == ("Hello, no calls. a <tool b", [])
    assert split_tool_calls("  \n") == ("  \n", [])
    for bad in ("<tool_call>\n{not json}\n</tool_call>", '<tool_call>["get_time"]</tool_call>',
                '<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
                '<tool_call>{"name": "f", "arguments": {}}', "x <tool_call"):
        assert split_tool_calls(bad) == (bad, []), bad  # malformed or unfinished: left as content
    content, calls = split_tool_calls('<tool_call>{"name": "f"}</tool_call> then <tool_call>oops</tool_call>')
    assert content == " then <tool_call>oops</tool_call>" and _calls(calls) == [(0, "f", {})]


def test_stream_split_at_every_boundary_equals_whole():
    text = "Sure <b>: " + CALL_TEXT + " <tool_call>{bad}</tool_call> done <tool_c"
    whole = split_tool_calls(text, _ids())
    assert whole[0] == "Sure <b>: <tool_call>{bad}</tool_call> done <tool_c" and len(whole[1]) == 2
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            content, calls = _streamed([text[:i], text[i:j], text[j:]])
            assert (content or None, calls) == (whole[0] or None, whole[1]), (i, j)


def test_stream_holds_only_a_possible_tag_start():
    p = ToolCallParser(_ids())
    assert p.feed("Hi <") == ["Hi"]  # the space waits: it is content only if content follows
    assert p.feed("b> and <tool") == [" <b> and"]
    assert p.feed("_call>\n{\"name\": \"get_time\"}\n</tool_") == []
    (call,) = p.feed("call>")
    assert call.name == "get_time" and call.arguments == "{}"
    assert p.feed("\n") == [] and p.flush() == []  # trailing whitespace after calls: dropped


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool", "_call>", "</", "<", ">", "\n", " ", "hi", "é€😀",
             '{"name": "f", "arguments": {"x": [1, "<tool_call>"]}}', '{"name": "g"}', '{"name": ', "{oops}",
             '\n{"name": "h", "arguments": {}}\n']


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=14), st.lists(st.integers(0, 200), max_size=8))
def test_stream_equals_whole_property(parts, cuts):
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    content, calls = _streamed(pieces)
    whole_content, whole_calls = split_tool_calls(text, _ids())
    assert calls == whole_calls
    assert content == (whole_content or "")
    if not calls:
        assert content == text  # nothing parsed: the text is untouched


# ---- through the server ------------------------------------------------------------------------------------
class _ScriptedEngine:
    """A stand-in engine: records the prompt and streams a fixed reply a few characters at a time."""

    def __init__(self, tokenizer, reply: str, finish_reason: str = "stop"):
        from turbospec.engine import GenStats

        self.tokenizer = tokenizer
        self.reply = reply
        self.finish_reason = finish_reason
        self.model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=tokenizer.vocab_size))
        self.ctx = 4096
        self.drafter = None
        self.last_stats = GenStats()
        self.prompts: list[list[int]] = []
        self.lock = threading.Lock()

    def stream(self, tokens, params, **kw):  # kw: the engine's abort check, not needed here
        from turbospec.engine import Chunk, GenStats

        self.prompts.append(list(tokens))
        pieces = [self.reply[i:i + 3] for i in range(0, len(self.reply), 3)]
        self.last_stats = GenStats(prompt_tokens=len(tokens), gen_tokens=len(pieces),
                                   finish_reason=self.finish_reason)
        for piece in pieces:
            yield Chunk([65], piece)


def _client(engine):
    from fastapi.testclient import TestClient

    from turbospec.server import ServerConfig, create_app

    # a loopback Host: a server without an API key refuses others
    return TestClient(create_app(engine, ServerConfig(model_name="tiny")), base_url="http://127.0.0.1")


def _events(r) -> list[dict]:
    assert r.status_code == 200, r.text
    assert r.text.rstrip().endswith("data: [DONE]")
    return [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]


def test_server_tool_calls_stream_and_not(tool_dir):
    types = pytest.importorskip("openai.types.chat")
    tk = _tokenizer(tool_dir)
    eng = _ScriptedEngine(tk, "I'll look.\n" + CALL_TEXT)
    req = {"messages": CONVERSATION[:2], "tools": [WEATHER, TIME], "max_tokens": 50}
    with _client(eng) as c:
        r = c.post("/v1/chat/completions", json=req)
        assert r.status_code == 200, r.text
        body = r.json()
        types.ChatCompletion.model_validate(body)  # the shape the official client reads
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        msg = choice["message"]
        assert msg["content"] == "I'll look."
        assert [(t["type"], t["function"]["name"], json.loads(t["function"]["arguments"]))
                for t in msg["tool_calls"]] == [("function", "get_weather", {"city": "Paris"}),
                                                ("function", "get_time", {})]
        assert all(t["id"].startswith("call_") for t in msg["tool_calls"])
        # the prompt the engine got: the tools rendered by the template
        assert eng.prompts[-1] == tk.encode(tk.render_chat(parse_messages(req), tools=[WEATHER, TIME]),
                                            add_special=False)
        assert "<tools>" in tk.decode(eng.prompts[-1]) and '"name": "get_weather"' in tk.decode(eng.prompts[-1])

        events = _events(c.post("/v1/chat/completions", json={**req, "stream": True}))
        chunks = [types.ChatCompletionChunk.model_validate(e) for e in events]
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        assert content == msg["content"]
        assert [(tc.index, tc.type, tc.function.name, tc.function.arguments) for tc in calls] == \
            [(i, t["type"], t["function"]["name"], t["function"]["arguments"])
             for i, t in enumerate(msg["tool_calls"])]
        assert all(tc.id.startswith("call_") for tc in calls)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not any("<tool_call>" in (ch.choices[0].delta.content or "") for ch in chunks)


def test_server_tool_call_edge_cases(tool_dir):
    tk = _tokenizer(tool_dir)
    with _client(_ScriptedEngine(tk, "\n" + CALL_TEXT)) as c:
        msg = c.post("/v1/chat/completions", json={"messages": CONVERSATION, "tools": [WEATHER, TIME]}).json()
        assert msg["choices"][0]["message"]["content"] is None  # only the calls (a tool round trip rendered)
        # tool_choice "none": the output is not parsed
        r = c.post("/v1/chat/completions", json={"messages": CONVERSATION[:2], "tools": [WEATHER],
                                                 "tool_choice": "none"}).json()
        assert r["choices"][0]["message"] == {"role": "assistant", "content": "\n" + CALL_TEXT}
        assert r["choices"][0]["finish_reason"] == "stop"
        # no tools: plain content
        r = c.post("/v1/chat/completions", json={"messages": CONVERSATION[:2], "stream": True})
        assert "tool_calls" not in r.text and "finish_reason\": \"stop" in r.text
    with _client(_ScriptedEngine(tk, CALL_TEXT, finish_reason="length")) as c:  # cut off: stays "length"
        r = c.post("/v1/chat/completions", json={"messages": CONVERSATION[:2], "tools": [WEATHER]}).json()
        assert r["choices"][0]["finish_reason"] == "length" and len(r["choices"][0]["message"]["tool_calls"]) == 2


def test_server_rejects_tools_without_template_support(plain_dir):
    tk = _tokenizer(plain_dir)
    with _client(_ScriptedEngine(tk, "x")) as c:
        for req, param in [
            ({"messages": CONVERSATION[:2], "tools": [WEATHER]}, "tools"),
            ({"messages": CONVERSATION[:4]}, "messages[2].tool_calls"),
            ({"messages": [{"role": "user"}]}, "messages[0].content"),
            ({"messages": CONVERSATION[:2], "tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
        ]:
            r = c.post("/v1/chat/completions", json=req)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error", err
        assert c.post("/v1/chat/completions", json={"messages": CONVERSATION[:2]}).status_code == 200


def test_openai_client_reads_tool_calls(tool_dir):
    openai = pytest.importorskip("openai")
    tk = _tokenizer(tool_dir)
    with _client(_ScriptedEngine(tk, CALL_TEXT)) as c:
        oc = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="unused", http_client=c, max_retries=0)
        r = oc.chat.completions.create(model="tiny", messages=CONVERSATION[:2], tools=[WEATHER, TIME])
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather", "get_time"]
        names = [tc.function.name
                 for ch in oc.chat.completions.create(model="tiny", messages=CONVERSATION, tools=[WEATHER],
                                                      stream=True)
                 if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        assert names == ["get_weather", "get_time"]
