"""Tokenizer (tokenizers' tokenizer.json) with the checkpoint's chat template and incremental decoding."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turbospec.errors import TurboSpecError

if TYPE_CHECKING:
    from jinja2 import Template


class Tokenizer:
    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(directory)
        tj = d / "tokenizer.json"
        if not tj.exists():
            raise TurboSpecError(f"no tokenizer.json in {d}")
        try:
            self.tok = HFTokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 -- tokenizers raises its own types; report them in one line
            raise TurboSpecError(f"{tj}: cannot load tokenizer ({' '.join(str(e).split())[:150]})") from None
        cfg: dict[str, Any] = {}
        tc = d / "tokenizer_config.json"
        if tc.exists():
            try:
                cfg = json.loads(tc.read_text())
            except json.JSONDecodeError as e:
                raise TurboSpecError(f"{tc} is not valid JSON: {e}") from None
        self.config = cfg
        self.chat_template = _chat_template(d, cfg)
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False)) and self.bos_token is not None
        self.eos_ids: set[int] = set()
        for t in (self.eos_token, "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>"):
            i = self.tok.token_to_id(t) if t is not None else None
            if i is not None and (t == self.eos_token or t in ("<|im_end|>", "<|eot_id|>")):
                self.eos_ids.add(i)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_token is not None:
            bos = self.tok.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    @cached_property
    def _template(self) -> Template:
        """The chat template compiled once, in a sandbox set up as transformers' apply_chat_template sets it up
        (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that neither
        sorts keys nor escapes HTML)."""
        if not self.chat_template:
            raise TurboSpecError("this tokenizer has no chat template (tokenizer_config.json chat_template)")
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

        def raise_exception(msg: str) -> None:
            raise TemplateError(msg)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = tojson
        try:
            return env.from_string(self.chat_template)
        except TemplateError as e:
            raise TurboSpecError(f"chat template error: {e}") from None

    @cached_property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (reads the variable `tools`)."""
        if not self.chat_template:
            return False
        from jinja2 import Environment, meta
        from jinja2.exceptions import TemplateError

        try:
            ast = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(self.chat_template)
        except TemplateError:
            return False
        return "tools" in meta.find_undeclared_variables(ast)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as prompt text, rendered as transformers' apply_chat_template renders it. `messages`
        are OpenAI-style dicts (an assistant's `tool_calls` with `function.arguments` as a dict); `tools` are
        OpenAI function-tool dicts, passed to the template as `tools` (None when there are none)."""
        if tools and not self.supports_tools:
            raise TurboSpecError("this model's chat template does not support tools")
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(
                messages=messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # a template that trips over a message it does not expect: the request's fault, reported in one line
            raise TurboSpecError(f"chat template error: {type(e).__name__}: {e}") from None


class StreamDecoder:
    """Turns a growing list of token ids into text pieces without splitting multi-byte characters.

    Each push decodes only the tokens since the last piece that ended on a whole character (plus the tokens of that
    piece, as context), so a long output costs the same per token as a short one. A piece is withheld while the
    text ends in an incomplete character (U+FFFD); the pieces concatenate to `decode(ids)`.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tk = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # first id of the context window: the start of the last emitted piece
        self.read = 0  # ids before this are emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        done = self.tk.decode(self.ids[self.prefix:self.read])
        text = self.tk.decode(self.ids[self.prefix:])
        if text.endswith("\ufffd") or len(text) <= len(done):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]

    def text(self) -> str:
        return self.tk.decode(self.ids)


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def _chat_template(d: Path, cfg: dict[str, Any]) -> str | None:
    jf = d / "chat_template.jinja"
    if jf.exists():
        return jf.read_text()
    t = cfg.get("chat_template")
    if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return t
