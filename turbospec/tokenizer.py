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
        self._setup(cfg, _chat_template(d, cfg))

    def _setup(self, cfg: dict[str, Any], chat_template: str | None, extra_eos: tuple[int, ...] = ()) -> None:
        """The attributes besides `tok`, from a tokenizer_config.json-shaped dict (a directory's, or one made from GGUF
        metadata)."""
        self.config = cfg
        self.chat_template = chat_template
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False)) and self.bos_token is not None
        self.eos_ids: set[int] = set()
        for t in (self.eos_token, "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>"):
            i = self.tok.token_to_id(t) if t is not None else None
            if i is not None and (t == self.eos_token or t in ("<|im_end|>", "<|eot_id|>")):
                self.eos_ids.add(i)
        self.eos_ids.update(extra_eos)

    @classmethod
    def from_gguf(cls, fields: dict[str, Any]) -> Tokenizer:
        """The tokenizer of a GGUF file, from its metadata (`fields`: key -> python value, as `gguf_metadata` gives):
        the `tokenizers` tokenizer Hugging Face uses for the original checkpoint, rebuilt from the vocabulary, token
        types, merges and pre-tokenizer name llama.cpp's converter stored; BOS/EOS and the chat template from the
        metadata. Byte-level BPE (`tokenizer.ggml.model` "gpt2") and SentencePiece BPE ("llama": Llama 2, Mistral 7B;
        its merges from the token scores)."""
        from tokenizers import Tokenizer as HFTokenizer

        spec, cfg, extra_eos = _gguf_tokenizer_spec(fields)
        try:
            tok = HFTokenizer.from_str(json.dumps(spec))
        except Exception as e:  # noqa: BLE001 -- tokenizers raises its own types; report them in one line
            raise TurboSpecError(f"GGUF tokenizer: cannot build it ({' '.join(str(e).split())[:150]})") from None
        obj = cls.__new__(cls)
        obj.tok = tok
        obj._setup(cfg, cfg.get("chat_template"), extra_eos)
        return obj

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


# --- GGUF (llama.cpp) tokenizers ------------------------------------------------------------------------------------

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# The pre-tokenizer regexes as the Hugging Face tokenizer.json files (and transformers' Qwen2/Qwen3.5 tokenizers)
# have them; llama.cpp's src/llama-vocab.cpp quotes them as "original regex from tokenizer.json" before its rewrites.
_QWEN2_RE = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_QWEN35_RE = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_LLAMA3_RE = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# Mistral's Tekken (Mistral Nemo, Mistral Small 3): words split at lower-to-upper case changes, digits one by one
_TEKKEN_RE = r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# OpenAI's o200k split (Phi-4-mini): Tekken's with contractions kept on words and digits in threes
_GPT4O_RE = r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# DeepSeek LLM's and DeepSeek Coder's tokenizer.json: a sequence of splits, each isolating its matches (then no regex
# in the byte-level step); llama.cpp quotes the same lists for "deepseek-llm" / "deepseek-coder". Written as escapes:
# some of the characters have canonical equivalents (U+2126 OHM SIGN, U+212A KELVIN SIGN) that text tools normalise
_DEEPSEEK_LLM_RES = (
    "[\\r\\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-"
    "\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b"
    "\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-"
    "\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
)
_DEEPSEEK_CODER_RES = ("[\\r\\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", "\\p{N}")
# llama.cpp's "default" (a missing tokenizer.ggml.pre): its own sequence of splits, no Hugging Face counterpart
_DEFAULT_RES = (r"[\p{P}\$\+<=>\^~\|]+", r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)""",
                r"\p{N}+", r"[0-9][0-9][0-9]")


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _byte_level(use_regex: bool, trim_offsets: bool = False) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": trim_offsets, "use_regex": use_regex}


def _seq(*pre: dict[str, Any]) -> dict[str, Any]:
    return {"type": "Sequence", "pretokenizers": list(pre)}


_NFC = {"type": "NFC"}
# tokenizer.ggml.pre -> (normalizer, pre_tokenizer, BPE ignore_merges, llama.cpp's default add_bos)
_PRE: dict[str, tuple[dict[str, Any] | None, dict[str, Any], bool, bool]] = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo"), (None, _byte_level(True, trim_offsets=True), False, False)),
    **dict.fromkeys(("starcoder", "smollm", "refact"),  # Digits(individual) + GPT-2's ByteLevel split
                    (None, _seq({"type": "Digits", "individual_digits": True}, _byte_level(True, trim_offsets=True)),
                     False, False)),
    # (llama.cpp reads the DeepSeek-R1 distills of Qwen and two more names as qwen2)
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"),
                    (_NFC, _seq(_split(_QWEN2_RE), _byte_level(False)), False, False)),
    "qwen35": (_NFC, _seq(_split(_QWEN35_RE), _byte_level(False)), False, False),
    # (and Falcon 3's, Pixtral's and two more as Llama 3's)
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "midm-2.0", "lfm2"),
                    (None, _seq(_split(_LLAMA3_RE), _byte_level(False, trim_offsets=True)), True, True)),
    **dict.fromkeys(("smaug-bpe", "dbrx"), (None, _seq(_split(_LLAMA3_RE), _byte_level(False, trim_offsets=True)),
                                            False, False)),
    "tekken": (None, _seq(_split(_TEKKEN_RE), _byte_level(False)), True, True),
    "gpt-4o": (None, _seq(_split(_GPT4O_RE), _byte_level(False)), False, False),
    "deepseek-llm": (None, _seq(*(_split(r) for r in _DEEPSEEK_LLM_RES), _byte_level(False, trim_offsets=True)),
                     False, False),
    "deepseek-coder": (None, _seq(*(_split(r) for r in _DEEPSEEK_CODER_RES), _byte_level(False, trim_offsets=True)),
                       False, False),
    "default": (None, _seq(*(_split(r) for r in _DEFAULT_RES), _byte_level(False)), False, False),
}


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """A `gguf.GGUFReader`'s key/value metadata as python values: str, int, float, bool, or a list of them (the
    reader's own `GGUF.*` header fields included). Strings that are not UTF-8 are decoded with replacement."""
    import numpy as np
    from gguf import GGUFValueType

    out: dict[str, Any] = {}
    for name, f in reader.fields.items():
        types = list(f.types)
        if not types:
            continue
        if types[0] == GGUFValueType.ARRAY:
            items = [f.parts[i] for i in f.data]
            if types[-1] == GGUFValueType.STRING:
                out[name] = [bytes(p).decode("utf-8", errors="replace") for p in items]
            else:
                out[name] = np.concatenate(items).tolist() if items else []
        elif types[0] == GGUFValueType.STRING:
            out[name] = bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
        else:
            out[name] = f.parts[f.data[0]].tolist()[0]
    return out


_SPACE = "\u2581"  # SentencePiece's word boundary, "▁"


def _spm_merges(fields: dict[str, Any], tokens: list[str], types: list[int], vocab: dict[str, int]) -> list[list[str]]:
    """The BPE merges a SentencePiece BPE vocabulary implies (llama.cpp's "llama" tokenizer: tokens with scores, no
    merge list): every split of a normal token into two normal tokens, the tokens by descending score (ties: lower
    id first), a token's splits by their halves' ids -- as transformers builds Llama's tokenizer.json from its
    SentencePiece model. SentencePiece merges the adjacent pair whose token scores highest; BPE the pair whose merge
    comes first."""
    scores = fields.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens) or \
            not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in scores):
        raise TurboSpecError(f"GGUF tokenizer: tokenizer.ggml.scores must be {len(tokens)} numbers (one per token)")
    normal = {t for t, ty in zip(tokens, types) if ty == _NORMAL and vocab.get(t) is not None}
    pairs: list[list[str]] = []
    for i in sorted((vocab[t] for t in normal if len(t) > 1), key=lambda i: (-scores[i], i)):
        t = tokens[i]
        splits = [(vocab[t[:k]], vocab[t[k:]]) for k in range(1, len(t)) if t[:k] in normal and t[k:] in normal]
        pairs += [[tokens[a], tokens[b]] for a, b in sorted(splits)]
    return pairs


def _spm_text(fields: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """SentencePiece's text handling as llama.cpp's "llama" tokenizer does it, as tokenizers' normalizer and decoder:
    spaces as "▁", one "▁" before the text and after every special token (`tokenizer.ggml.add_space_prefix`,
    default true), byte tokens (<0x0A>) for characters outside the vocabulary; decoding undoes them and drops the
    leading space."""
    prefix = fields.get("tokenizer.ggml.add_space_prefix", True)
    if not isinstance(prefix, bool):
        raise TurboSpecError(f"GGUF tokenizer: tokenizer.ggml.add_space_prefix {prefix!r} is not a bool")
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}
    normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": _SPACE}, replace]} if prefix \
        else replace
    steps = [{"type": "Replace", "pattern": {"String": _SPACE}, "content": " "}, {"type": "ByteFallback"},
             {"type": "Fuse"}]
    if prefix:
        steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return normalizer, {"type": "Sequence", "decoders": steps}


def _gguf_tokenizer_spec(fields: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], tuple[int, ...]]:
    """The tokenizer.json (as a dict), a tokenizer_config.json-shaped dict and the extra end-of-generation ids that
    GGUF metadata describes; one-line TurboSpecError for metadata it cannot describe."""
    if not isinstance(fields, dict):
        raise TurboSpecError(f"GGUF tokenizer: metadata must be a dict, not {type(fields).__name__}")
    model = fields.get("tokenizer.ggml.model")
    if model is None:
        raise TurboSpecError("GGUF tokenizer: no tokenizer.ggml.model in the metadata (a file without a tokenizer)")
    if model not in ("gpt2", "llama"):
        raise TurboSpecError(f"GGUF tokenizer: tokenizer.ggml.model {model!r} is not supported "
                             "(supported: 'gpt2', byte-level BPE; 'llama', SentencePiece BPE)")
    spm = model == "llama"
    if spm:  # (llama.cpp's SentencePiece tokenizer splits no words: its converter writes pre "default")
        normalizer, pre_tokenizer, ignore_merges, add_bos_default = None, None, False, True
    else:
        pre = fields.get("tokenizer.ggml.pre", "default")
        if not isinstance(pre, str) or pre not in _PRE:
            raise TurboSpecError(f"GGUF tokenizer: tokenizer.ggml.pre {pre!r} is not supported "
                                 f"(supported: {', '.join(sorted(_PRE))})")
        normalizer, pre_tokenizer, ignore_merges, add_bos_default = _PRE[pre]

    tokens = fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise TurboSpecError("GGUF tokenizer: tokenizer.ggml.tokens is missing or not a list of strings")
    n = len(tokens)
    types = fields.get("tokenizer.ggml.token_type", [_NORMAL] * n)
    if not isinstance(types, list) or len(types) != n or not all(type(t) is int for t in types):
        raise TurboSpecError(f"GGUF tokenizer: tokenizer.ggml.token_type must be {n} integers (one per token)")

    vocab: dict[str, int] = {}
    added: list[dict[str, Any]] = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == _UNUSED or t in vocab:  # llama.cpp's "[PAD<i>]" fillers up to the embedding rows: no token in HF
            continue
        # added tokens are in the BPE vocabulary too: `tokenizers` gives an added token that is not the next free id
        # only when the model has it (merges never build them, so BPE results do not change)
        vocab[t] = i
        if ty in (_CONTROL, _USER_DEFINED, _UNKNOWN):  # the checkpoint's added tokens (special ones: control)
            added.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": ty != _USER_DEFINED})
    if spm:
        pairs = _spm_merges(fields, tokens, types, vocab)
    else:
        merges = fields.get("tokenizer.ggml.merges")
        if not isinstance(merges, list) or not merges or not all(isinstance(m, str) for m in merges):
            raise TurboSpecError("GGUF tokenizer: tokenizer.ggml.merges is missing or not a list of strings")
        pairs = []
        for m in merges:
            k = m.find(" ", 1)  # as llama.cpp splits them (a space never starts a byte-level token)
            if k < 0 or k == len(m) - 1:
                raise TurboSpecError(f"GGUF tokenizer: merge {m[:40]!r} is not two tokens separated by a space")
            pairs.append([m[:k], m[k + 1:]])

    def token_id(key: str) -> int | None:
        v = fields.get(key)
        if v is None:
            return None
        if type(v) is not int or not 0 <= v < n:
            raise TurboSpecError(f"GGUF tokenizer: {key} {v!r} is not a token id (vocabulary of {n})")
        return v

    bos, eos = token_id("tokenizer.ggml.bos_token_id"), token_id("tokenizer.ggml.eos_token_id")
    eog = tuple(i for i in (eos, token_id("tokenizer.ggml.eot_token_id"), token_id("tokenizer.ggml.eom_token_id"))
                if i is not None)
    add_bos = fields.get("tokenizer.ggml.add_bos_token", add_bos_default)
    if not isinstance(add_bos, bool):
        raise TurboSpecError(f"GGUF tokenizer: tokenizer.ggml.add_bos_token {add_bos!r} is not a bool")
    template = fields.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise TurboSpecError("GGUF tokenizer: tokenizer.chat_template is not a string")

    steps: list[dict[str, Any]] = [] if spm else [_byte_level(True)]
    if add_bos and bos is not None:  # as Llama's tokenizer.json: (ByteLevel, then) "<bos> $A"
        b = {"SpecialToken": {"id": tokens[bos], "type_id": 0}}
        steps.append({
            "type": "TemplateProcessing",
            "single": [b, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [b, {"Sequence": {"id": "A", "type_id": 0}}, b, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {tokens[bos]: {"id": tokens[bos], "ids": [bos], "tokens": [tokens[bos]]}}})
    post = None if not steps else steps[0] if len(steps) == 1 else {"type": "Sequence", "processors": steps}
    decoder: dict[str, Any] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    unk = None
    if spm:
        normalizer, decoder = _spm_text(fields)
        unk = next((t for t, ty in zip(tokens, types) if ty == _UNKNOWN), None)
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer, "post_processor": post, "decoder": decoder,
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": spm, "byte_fallback": spm,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": pairs},
    }
    cfg = {"bos_token": tokens[bos] if bos is not None else None, "eos_token": tokens[eos] if eos is not None else None,
           "add_bos_token": add_bos, "chat_template": template}
    return spec, cfg, eog
