"""The engine: chunked prefill, the decode loop, stop conditions and timing stats."""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from turbospec.errors import TurboSpecError
from turbospec.kv.plan import AttentionPlan
from turbospec.sampling import Sampler, SamplingParams
from turbospec.spec.base import SpecStats
from turbospec.spec.tree import DraftTree
from turbospec.spec.verify import verify
from turbospec.tokenizer import StreamDecoder, Tokenizer


@dataclass
class GenStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused from the previous request (not recomputed)
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    gen_tokens: int = 0
    decode_s: float = 0.0
    peak_rss_bytes: int = 0
    finish_reason: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def prefill_tps(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens after the first one, over the time after the first token."""
        n = self.gen_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def line(self) -> str:
        spec = self.extra.get("spec")
        tail = f" | {spec.line()}" if spec is not None else ""
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        return (
            f"prompt {self.prompt_tokens} tok{cached}, prefill {self.prefill_tps:.1f} t/s, ttft {self.ttft_s * 1e3:.0f} ms"
            f" | gen {self.gen_tokens} tok, decode {self.decode_tps:.1f} t/s"
            f" | peak mem {self.peak_rss_bytes / 2**20:.0f} MiB" + tail
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        if "spec" in self.extra:
            d["extra"] = {**self.extra, "spec": self.extra["spec"].to_dict()}
        d.update(prefill_tps=self.prefill_tps, decode_tps=self.decode_tps)
        return d


@dataclass
class Chunk:
    """One streamed step: the new token ids and the text they complete (may be empty)."""

    tokens: list[int]
    text: str


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Engine:
    """Drives a model: tokenize, prefill in ubatch-sized chunks, decode, sample, stop."""

    def __init__(self, model, tokenizer: Tokenizer | None = None, ctx: int = 4096, ubatch: int = 512,
                 batch: int = 2048, drafter=None, n_max: int = 3,
                 prefix_cache: bool = True, cache_type_k: str | None = None, cache_type_v: str | None = None):
        if ctx <= 0 or ubatch <= 0 or batch <= 0:
            raise TurboSpecError("context, batch and ubatch sizes must be positive")
        self.model = model
        self.tokenizer = tokenizer
        self.ctx = ctx
        self.ubatch = min(ubatch, batch)
        self.batch = batch
        self.cache_type_k, self.cache_type_v = cache_type_k, cache_type_v
        if cache_type_k or cache_type_v:
            self.cache = model.new_cache(ctx, k_type=cache_type_k, v_type=cache_type_v)
        else:
            self.cache = model.new_cache(ctx)
        self.drafter = drafter
        self.n_max = n_max
        self.prefix_cache = prefix_cache
        self.cached_tokens: list[int] = []
        self.reused_tokens = 0
        self.last_stats = GenStats()
        # The model's thousands of long-lived objects out of the cyclic GC's reach (vLLM does the same after start-up):
        # a decode step allocates enough small objects to trigger collections that would traverse them all.
        gc.freeze()

    # ---- building blocks -------------------------------------------------------------------------------
    def prefill(self, tokens: list[int], rows: int | None = 1) -> torch.Tensor:
        """Run the prompt through the model in ubatch chunks; return the hidden rows of the last `rows` prompt
        positions ([rows, H]; None: every computed position, for drafters that read the target's hidden states).
        Positions reused from the cache have no rows. Each chunk's last layer computes only the rows kept.

        Prefix reuse: positions whose tokens equal those already in the cache are kept (at least one token is
        always recomputed), as llama-server's prompt cache does; caches without `truncate` start over."""
        reuse = 0
        if self.prefix_cache and hasattr(self.cache, "truncate"):
            limit = min(len(self.cached_tokens), len(tokens) - 1, self.cache.length)
            while reuse < limit and self.cached_tokens[reuse] == tokens[reuse]:
                reuse += 1
        if reuse:
            self.cache.truncate(reuse)
        else:
            self.cache.reset()
        self.reused_tokens = reuse
        self.cached_tokens = list(tokens)
        ids = torch.tensor(tokens, dtype=torch.int64)
        n, out = len(tokens), []
        for s in range(reuse, n, self.ubatch):
            chunk = ids[s:s + self.ubatch]
            e = s + chunk.numel()
            want = None if rows is None else min(e - s, max(1, e - (n - rows)))  # rows of this chunk kept
            hidden = self.model.forward(chunk, AttentionPlan.causal(self.cache.length, chunk.numel()), self.cache,
                                        out_rows=want)
            self.cache.commit()
            out.append(hidden)
        hidden = torch.cat(out) if len(out) > 1 else out[0]
        return hidden if rows is None else hidden[-min(rows, n - reuse):]

    def step(self, token: int) -> torch.Tensor:
        plan = AttentionPlan.causal(self.cache.length, 1)
        hidden = self.model.forward(torch.tensor([token], dtype=torch.int64), plan, self.cache)
        self.cache.commit()
        return hidden

    def verify_step(self, root: int, tree: DraftTree, sampler: Sampler) -> tuple[list[int], int, torch.Tensor]:
        """One target forward over [root] + draft nodes; commit the accepted path.

        Returns (accepted node indices, next token, hidden rows of the committed tokens)."""
        start = self.cache.length
        toks = torch.tensor([root] + tree.tokens, dtype=torch.int64)
        if tree.is_chain:
            plan = AttentionPlan.causal(start, toks.numel())
        else:
            plan = AttentionPlan.tree(start, [-1] + [p + 1 for p in tree.parents])
        hidden = self.model.forward(toks, plan, self.cache)
        path, nxt = verify(tree, self.model.logits(hidden), sampler)
        keep = [0] + [1 + i for i in path]
        self.cache.commit(keep)
        return path, nxt, hidden[keep]

    def encode_prompt(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise TurboSpecError("a tokenizer is needed for text prompts")
        if chat:
            prompt = self.tokenizer.render_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt, add_special=not chat)

    # ---- generation ------------------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, chat: bool = False
               ) -> Iterator[Chunk]:
        """Yield generated tokens (with text when a tokenizer is present); stats land in `last_stats`."""
        params = params or SamplingParams()
        tokens = self.encode_prompt(prompt, chat)
        if not tokens:
            raise TurboSpecError("empty prompt")
        if len(tokens) + max(params.max_tokens, 1) > self.ctx:
            raise TurboSpecError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({params.max_tokens}) exceeds context size {self.ctx}"
            )
        stats = GenStats(prompt_tokens=len(tokens))
        spec = SpecStats()
        self.last_stats = stats
        if self.drafter is not None:
            stats.extra["spec"] = spec
        sampler = Sampler(params)
        sampler.accept(tokens)
        eos = set() if params.ignore_eos else self._eos_ids()
        dec = StreamDecoder(self.tokenizer) if self.tokenizer else None
        stops = [s for s in params.stop if s]
        held = ""  # text withheld because it may be the start of a stop string
        drafter = self.drafter
        t0 = time.perf_counter()
        rows = 1
        if drafter is not None and drafter.needs_hidden:
            rows = drafter.prompt_rows(len(tokens)) if hasattr(drafter, "prompt_rows") else None
        hidden = self.prefill(tokens, rows)
        if drafter is not None:
            drafter.begin(tokens, hidden if drafter.needs_hidden else None)
        stats.prefill_s = time.perf_counter() - t0
        stats.cached_tokens = self.reused_tokens
        pending = [sampler.sample(self.model.logits(hidden[-1:])[0])]
        context = self.cached_tokens  # grows in place: always the tokens whose KV is committed
        t_first = None
        done = False
        while not done:
            for tok in pending:
                stats.gen_tokens += 1
                if t_first is None:
                    t_first = time.perf_counter()
                    stats.ttft_s = t_first - t0
                if tok in eos:
                    stats.finish_reason = "stop"
                    done = True
                    break
                text = dec.push(tok) if dec else ""
                if stops:
                    held += text
                    cut = _find_stop(held, stops)
                    if cut is not None:
                        if held[:cut]:
                            yield Chunk([tok], held[:cut])
                        held = ""
                        stats.finish_reason = "stop"
                        done = True
                        break
                    safe = _safe_prefix_len(held, stops)
                    text, held = held[:safe], held[safe:]
                yield Chunk([tok], text)
                if stats.gen_tokens >= params.max_tokens:
                    stats.finish_reason = "length"
                    done = True
                    break
            if done:
                break
            if self.cache.length + 1 >= self.ctx:
                stats.finish_reason = "length"
                break
            root = pending[-1]
            context.append(root)
            # room: the most drafts one step may accept (tree depth); slots: cache rows left for draft nodes
            room = min(params.max_tokens - stats.gen_tokens - 1, self.n_max)
            slots = self.ctx - self.cache.length - 1
            tree = drafter.propose(context, room) if drafter is not None and min(room, slots) > 0 else DraftTree()
            if len(tree):
                tree = tree.limit(room, slots)
            if len(tree):
                path, nxt, rows = self.verify_step(root, tree, sampler)
                spec.record(tree, len(path))
                accepted = [tree.tokens[i] for i in path]
            else:
                rows = self.step(root)
                nxt, accepted = sampler.sample(self.model.logits(rows)[0]), []
            if drafter is not None:
                drafter.accept([root] + accepted, rows, nxt)
            context += accepted
            pending = accepted + [nxt]
        if held:
            yield Chunk([], held)
        stats.finish_reason = stats.finish_reason or "length"
        if t_first is not None:
            stats.decode_s = time.perf_counter() - t_first
        stats.peak_rss_bytes = peak_rss_bytes()

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None,
                 chat: bool = False) -> list[dict]:
        """Batch API: run each prompt to completion; returns dicts with text, token ids and stats."""
        out = []
        for p in prompts:
            toks: list[int] = []
            text = []
            for ch in self.stream(p, params, chat):
                toks += ch.tokens
                text.append(ch.text)
            out.append({"text": "".join(text), "tokens": toks, "stats": self.last_stats})
        return out

    def _eos_ids(self) -> set[int]:
        ids = set(self.model.cfg.eos_token_ids)
        if self.tokenizer is not None:
            ids |= self.tokenizer.eos_ids
        return ids


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def _safe_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the prefix of `text` that cannot be the beginning of any stop string."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = max(keep, k)
                break
    return len(text) - keep
