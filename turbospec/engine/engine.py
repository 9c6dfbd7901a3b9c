"""The engine: chunked prefill, the decode loop with speculative steps, stop conditions and timing stats."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator

import torch

from turbospec import device as compute_device
from turbospec.config import EngineConfig
from turbospec.engine.stats import Chunk, ExpertUse, GenStats, disk_read_bytes, peak_rss_bytes
from turbospec.engine.stops import TextStream
from turbospec.errors import TurboSpecError
from turbospec.kv.base import Cache
from turbospec.kv.plan import AttentionPlan
from turbospec.layers.linear import skinny_rows
from turbospec.model.base import Model
from turbospec.sampling import Sampler, SamplingParams, TokenLogprob, logprobs_of
from turbospec.speculative.adaptive import Controller, StepCosts, calibrate, first_miss
from turbospec.speculative.drafter import Drafter
from turbospec.speculative.stats import SpecStats
from turbospec.speculative.tree import DraftTree
from turbospec.speculative.verify import verify
from turbospec.tokenizer import Tokenizer
from turbospec.tokens import common_prefix

HOLD = 64  # most steps without a draft whose commits wait to be told to the drafter in one call


class Aborted(Exception):
    """Prefill stopped because the caller's `abort` check said so."""


class Engine:
    """Drives a model: tokenize, prefill in ubatch-sized chunks, decode (with drafts when a drafter is given),
    sample, stop. `turbospec.build_engine(config)` loads everything from an `EngineConfig`; constructing one
    directly takes an already loaded model (tests, the lab)."""

    def __init__(self, model: Model, tokenizer: Tokenizer | None = None, config: EngineConfig | None = None,
                 drafter: Drafter | None = None, model_path: str | None = None):
        config = config or EngineConfig()
        self.config = config
        self.model = model
        self.device = compute_device.current()  # where the step's token ids are made (the model's device)
        # a decode step runs with torch's default-device hook off on a GPU (device.lean); not for mixture-of-experts
        # models whose experts are not stacked on the device (their grouped path makes tensors on the default device)
        self.lean = compute_device.lean if not model.experts.grouped else contextlib.nullcontext
        self.tokenizer = tokenizer
        self.model_path = model_path  # the checkpoint directory, when loaded from one
        self._cache: Cache | None = None  # allocated on first use (a server with --parallel never uses it)
        self.drafter = drafter
        self.cached_tokens: list[int] = []
        self.reused_tokens = 0
        self.step_costs: StepCosts | None = None  # adaptive speculation's cost model, calibrated on first use
        # a verification step holds at most the rows the one-call decoder layer takes (16 in float32, 64 in bf16 with
        # AVX-512 BF16): beyond, the op-by-op path (torch GEMM, SDPA) made 24-deep suffix drafts 20-25% slower than
        # 15-deep ones in float32 (docs/speculative.md)
        self.step_rows = skinny_rows(model.dtype)
        self.last_stats = GenStats()
        # tensor parallelism: this rank's (accepted draft nodes, next token) -> rank 0's (turbospec.parallel.tp)
        self.agree: Callable[[list[int], int], tuple[list[int], int]] | None = None
        # and adaptive speculation's choice of a step: [draft tokens, probe, width, idle steps after] -> rank 0's
        self.agree_plan: Callable[[list[int]], list[int]] | None = None
        # The model's thousands of long-lived objects out of the cyclic GC's reach (vLLM does the same after start-up):
        # a decode step allocates enough small objects to trigger collections that would traverse them all.
        gc.freeze()

    @property
    def cache(self) -> Cache:
        """The one sequence's cache (`ctx` positions), allocated on first use."""
        if self._cache is None:
            c = self.config
            self._cache = self.model.new_cache(c.ctx, k_type=c.cache_type_k, v_type=c.cache_type_v,
                                               checkpoints=c.ctx_checkpoints if c.prefix_cache else 0)
        return self._cache

    @property
    def ctx(self) -> int:
        """Context size in tokens (prompt + output)."""
        return self.config.ctx

    # ---- building blocks -------------------------------------------------------------------------------
    def prefill(self, tokens: list[int], rows: int | None = 1, reuse_prefix: bool = True,
                abort: Callable[[], bool] | None = None,
                progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Run the prompt through the model in ubatch chunks; return the hidden rows of the last `rows` prompt
        positions ([rows, H]; None: every computed position, for drafters that read the target's hidden states).
        Positions reused from the cache have no rows. Each chunk's last layer computes only the rows kept.

        Prefix reuse (unless `reuse_prefix` is False): positions whose tokens equal those already in the cache
        are kept (at least one token is always recomputed), as llama-server's prompt cache does, back to the
        longest prefix the cache can resume from (a hybrid's: its committed length or a checkpoint, see
        `HybridCache`; every prompt is checkpointed before its last token, so that the same prompt again, or one
        that continues it, resumes there). `abort` is asked between chunks; when it answers True, `Aborted` is
        raised and the cache keeps the chunks already computed. `progress(done, n)` is told the prompt positions
        in the cache after each chunk (a caller's prefill bar)."""
        reuse = 0
        if reuse_prefix and self.config.prefix_cache:
            limit = min(len(self.cached_tokens), len(tokens) - 1, self.cache.length)
            reuse = self.cache.resume_point(common_prefix(self.cached_tokens, tokens, limit))
        if reuse:
            self.cache.truncate(reuse)
        else:
            self.cache.reset()
        self.reused_tokens = reuse
        self.cached_tokens = list(tokens)
        ids = torch.tensor(tokens[reuse:], dtype=torch.int64, device=self.device)  # (positions from `reuse` on)
        n, out = len(tokens), []
        ubatch = self.config.ubatch
        bounds = [*range(reuse, n, ubatch), n]
        mark = n - 1  # a cache that resumes only at checkpoints keeps one before the prompt's last token, where the
        if not self.cache.prefix_reusable and reuse < mark and mark not in bounds:  # same prompt again resumes
            bounds.insert(-1, mark)
        for s, e in zip(bounds, bounds[1:]):
            if abort is not None and s > reuse and abort():
                self.cached_tokens = self.cached_tokens[:self.cache.length]
                raise Aborted
            chunk = ids[s - reuse:e - reuse]
            want = None if rows is None else min(e - s, max(1, e - (n - rows)))  # rows of this chunk kept
            hidden = self.model.forward(chunk, AttentionPlan.causal(self.cache.length, chunk.numel()), self.cache,
                                        out_rows=want)
            self.cache.commit()
            if e == mark:
                self.cache.checkpoint()
            out.append(hidden)
            if progress is not None:
                progress(e, n)
        hidden = torch.cat(out) if len(out) > 1 else out[0]
        return hidden if rows is None else hidden[-min(rows, n - reuse):]

    def step(self, token: int) -> torch.Tensor:
        plan = AttentionPlan.causal(self.cache.length, 1)
        hidden = self.model.forward(torch.tensor([token], dtype=torch.int64, device=self.device), plan, self.cache)
        self.cache.commit()
        return hidden

    def verify_step(self, root: int, tree: DraftTree, sampler: Sampler) -> tuple[list[int], int, torch.Tensor]:
        """One target forward over [root] + draft nodes; commit the accepted path.

        Returns (accepted node indices, next token, hidden rows of the committed tokens)."""
        start = self.cache.length
        toks = torch.tensor([root] + tree.tokens, dtype=torch.int64, device=self.device)
        if tree.is_chain:
            plan = AttentionPlan.causal(start, toks.numel())
        else:
            plan = AttentionPlan.tree(start, [-1] + [p + 1 for p in tree.parents], self.device)
        hidden = self.model.forward(toks, plan, self.cache)
        path, nxt = self.decide(sampler, lambda: verify(tree, self.model.logits(hidden), sampler), tree)
        keep = [0] + [1 + i for i in path]
        self.cache.commit(keep)
        return path, nxt, hidden[keep]

    def new_scheduler(self, parallel: int):
        """A continuous-batching scheduler over this engine's model (`Scheduler.for_engine`)."""
        from turbospec.engine.scheduler import Scheduler

        return Scheduler.for_engine(self, parallel)

    def decide(self, sampler: Sampler, pick: Callable[[], tuple[list[int], int]], tree: DraftTree | None = None
               ) -> tuple[list[int], int]:
        """`pick()`'s (accepted nodes of `tree`, next token). Under tensor parallelism rank 0 decides: every rank
        picks (the same, from the same gathered logits and seed), then takes rank 0's choice (`agree`), its
        sampler's penalty window set to match."""
        if self.agree is None:
            return pick()
        window = sampler.window
        path, nxt = pick()
        agreed = self.agree(path, nxt)
        if agreed != (path, nxt):
            path, nxt = agreed
            sampler.window = window
            sampler.accept([tree.tokens[i] for i in path] + [nxt] if tree is not None else [nxt])
        return path, nxt

    def next_token(self, sampler: Sampler, hidden: torch.Tensor) -> int:
        """The token after the hidden row [1, H], drawn by `sampler` (rank 0's under tensor parallelism)."""
        return self.decide(sampler, lambda: ([], sampler.sample(self.model.logits(hidden)[0])))[1]

    def encode_prompt(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise TurboSpecError("a tokenizer is needed for text prompts")
        if chat:
            prompt = self.tokenizer.render_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt, add_special=not chat)

    # ---- generation ------------------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, chat: bool = False,
               abort: Callable[[], bool] | None = None,
               progress: Callable[[int, int], None] | None = None) -> Iterator[Chunk]:
        """Yield generated tokens (with text when a tokenizer is present); stats land in `last_stats`.

        `abort` (a server's cancel check) is asked between prefill chunks: when it answers True the stream ends
        without tokens and `finish_reason` "abort". Between tokens the caller stops by closing the iterator.
        `progress`: the prefill's, as `prefill`'s."""
        params = params or SamplingParams()
        tokens = self.encode_prompt(prompt, chat)
        if not tokens:
            raise TurboSpecError("empty prompt")
        if len(tokens) + params.max_tokens > self.ctx:
            raise TurboSpecError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({params.max_tokens}) exceeds context size {self.ctx}"
            )
        vocab = self.model.cfg.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise TurboSpecError(f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary "
                                 f"[0, {vocab})")
        stats = GenStats(prompt_tokens=len(tokens))
        spec = SpecStats()
        self.last_stats = stats
        if self.drafter is not None:
            stats.spec = spec
        sampler = Sampler(params)
        sampler.accept(tokens)
        eos = set() if params.ignore_eos else self.eos_ids()
        texts = TextStream(self.tokenizer, params.stop)
        drafter = self.drafter
        t0 = time.perf_counter()
        want: int | None = 1  # prompt rows whose hidden states are needed (None: all)
        if drafter is not None and drafter.needs_hidden:
            want = drafter.prompt_rows(len(tokens))
        prompt_lp = params.prompt_logprobs
        # prompt logprobs need every prompt row: no prefix reuse, all rows kept
        try:
            hidden = self.prefill(tokens, None if prompt_lp is not None else want, reuse_prefix=prompt_lp is None and params.cache_prompt,
                                  abort=abort, progress=progress)
        except Aborted:
            stats.prefill_s = time.perf_counter() - t0
            stats.finish_reason = "abort"
            return
        first: Chunk | None = None
        if prompt_lp is not None:
            first = Chunk([], "", prompt_logprobs=[None, *self._prompt_logprobs(tokens, hidden, prompt_lp)])
            hidden = hidden if want is None else hidden[-want:]
        stats.cached_tokens = self.reused_tokens
        if params.max_tokens == 0:  # prefill only (prompt logprobs for log-likelihood evaluation)
            stats.prefill_s = time.perf_counter() - t0
            stats.finish_reason = "length"
            stats.peak_rss_bytes = peak_rss_bytes()
            if first is not None:
                yield first
            return
        if drafter is not None:
            drafter.sampling(params)
            drafter.begin(tokens, hidden if drafter.needs_hidden else None)
        stats.prefill_s = time.perf_counter() - t0
        ctl = self._controller() if drafter is not None and self.config.spec.adaptive else None
        # adaptive tree width: greedy requests to a drafter that drafts several candidates per depth
        wide = ctl is not None and ctl.width_max > 1 and params.greedy
        if drafter is not None:
            drafter.set_width(drafter.widths())  # a request starts at the configured width
        if first is not None:
            yield first
        pending = [self.next_token(sampler, hidden[-1:])]
        want_lp = params.logprobs is not None  # then pending_lp[i] is the logprobs of pending[i]
        pending_lp = sampler.take_logprobs() if want_lp else []
        context = self.cached_tokens  # grows in place: always the tokens whose KV is committed
        experts = self.model.experts if self.model.experts.entries or self.model.experts.stats.misses else None
        at_first: tuple[int, int, int, int] | None = None  # expert counters when the first token came
        t_first = None
        done = False
        depth = self.config.spec.depth  # the deepest draft a step may verify
        # commits of steps without a draft (adaptive speculation's idle steps, empty drafts), told to the drafter in one
        # call before it next drafts: on a model small enough that a step is ~0.3 ms, telling it each step cost ~1%
        untold: list[int] = []
        untold_rows: list[torch.Tensor] = []
        untold_next = 0

        def tell() -> None:
            if untold and drafter is not None:
                drafter.accept(untold, untold_rows[0] if len(untold_rows) == 1 else torch.cat(untold_rows), untold_next)
                untold.clear()
                untold_rows.clear()

        try:  # (a caller that stops early closes the generator: the timings still hold)
            while not done:
                for i, tok in enumerate(pending):
                    lp = [pending_lp[i]] if want_lp else None
                    stats.gen_tokens += 1
                    if t_first is None:
                        t_first = time.perf_counter()
                        stats.ttft_s = t_first - t0
                        if experts is not None:
                            e = experts.stats
                            at_first = (e.hits, e.misses, e.loaded_bytes, disk_read_bytes())
                    if tok in eos:
                        stats.finish_reason = "stop"
                        done = True
                        break
                    text, stopped = texts.push(tok)
                    if stopped:
                        if text:
                            yield Chunk([tok], text, lp)
                        stats.finish_reason = "stop"
                        done = True
                        break
                    yield Chunk([tok], text, lp)
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
                room = min(params.max_tokens - stats.gen_tokens - 1, depth)
                slots = min(self.ctx - self.cache.length, self.cache.step_rows, self.step_rows) - 1
                shadow = False  # a probe of adaptive speculation: a draft checked against a plain step, not verified
                asked = False  # adaptive speculation chose this step (and times it)
                if ctl is not None and min(room, slots) > 0:
                    if ctl.idle:  # drafting is off and nothing is due: a plain step with no bookkeeping
                        ctl.idle -= 1
                        room = 0
                        spec.skipped += 1
                    else:
                        asked = True
                        room = ctl.choose(min(room, slots), self.cache.length, params.max_tokens - stats.gen_tokens)
                        width = ctl.width(room, slots) if wide else 1
                        if self.agree_plan is not None:  # rank 0's choice (each rank timed its own steps)
                            room, probe, width, ctl.idle = self.agree_plan([room, int(ctl.shadow), width, ctl.idle])
                            ctl.shadow = bool(probe)
                        shadow = ctl.shadow
                        spec.skipped += room == 0 or shadow
                        if wide and drafter is not None:
                            drafter.set_width(width)
                with self.lean():  # (no yield inside: the hook is off only for this step's work)
                    t_step = time.perf_counter()
                    if drafter is not None and min(room, slots) > 0:
                        tell()
                        tree = drafter.propose(context, room)
                    else:
                        tree = DraftTree()
                    if len(tree):
                        tree = tree.limit(room, slots)
                    t_drafted = time.perf_counter()
                    if len(tree) and not shadow:
                        path, nxt, hidden_rows = self.verify_step(root, tree, sampler)
                        spec.record(tree, len(path))
                        accepted = [tree.tokens[i] for i in path]
                    else:
                        hidden_rows = self.step(root)
                        nxt = self.next_token(sampler, hidden_rows)
                        accepted = []
                    if ctl is not None and asked:
                        if shadow:  # the plain step's token is what a verification would have accepted first
                            path = [i for i in range(len(tree)) if tree.depth(i) == 1 and tree.tokens[i] == nxt][:1]
                            ctl.costs.observe(0, time.perf_counter() - t_drafted, 0.0, self.cache.length)
                            ctl.costs.observe_probe(t_drafted - t_step)
                        else:
                            ctl.costs.observe(len(tree), time.perf_counter() - t_drafted, t_drafted - t_step,
                                              self.cache.length)
                        if len(tree):  # (a plain step teaches the acceptance nothing)
                            ranked = drafter.ranked() if wide and drafter is not None else []
                            # the best candidates accepted in a row (an accepted alternative ends the path: not counted)
                            spine, miss, target = first_miss(tree, path, nxt, ranked)
                            ctl.observe(max(tree.depth(i) for i in range(len(tree))), spine)
                            if miss >= 0:
                                ctl.observe_alternatives(miss, ranked[miss], target)
                    if drafter is not None:
                        if len(tree):
                            drafter.accept([root] + accepted, hidden_rows, nxt)
                        else:
                            untold.append(root)
                            untold_rows.append(hidden_rows)
                            untold_next = nxt
                            if len(untold) >= HOLD:
                                tell()
                context += accepted
                pending = accepted + [nxt]
                if want_lp:
                    pending_lp = sampler.take_logprobs()
            held = texts.flush()
            if held:
                yield Chunk([], held)
            stats.finish_reason = stats.finish_reason or "length"
        finally:
            if t_first is not None:
                stats.decode_s = time.perf_counter() - t_first
            stats.peak_rss_bytes = peak_rss_bytes()
            if experts is not None and at_first is not None:
                e = experts.stats
                stats.experts = ExpertUse(e.hits - at_first[0], e.misses - at_first[1], e.loaded_bytes - at_first[2],
                                          disk_read_bytes() - at_first[3], max(0, stats.gen_tokens - 1))
            if drafter is not None:
                tell()
                drafter.finish(list(context))

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

    def _prompt_logprobs(self, tokens: list[int], hidden: torch.Tensor, k: int) -> list[TokenLogprob]:
        """The logprobs of prompt tokens 1.. from the rows before them (raw logits: no bias or penalties), in
        slices of rows so that the [rows, vocab] logits stay small (64 x 152K float32: 39 MB)."""
        out: list[TokenLogprob] = []
        step = 64
        for s in range(0, len(tokens) - 1, step):
            e = min(s + step, len(tokens) - 1)
            out += logprobs_of(self.model.logits(hidden[s:e]), tokens[s + 1:e + 1], k)
        return out

    def _controller(self) -> Controller:
        """Adaptive speculation for one request: acceptance from the prior, the engine's cost model (calibrated
        on a scratch cache the first time)."""
        n_max = self.config.spec.n_max
        if self.step_costs is None:
            self.step_costs = calibrate(self.model, n_max, self.config.spec)
        return Controller(self.step_costs, n_max, width_max=self.drafter.widths() if self.drafter is not None else 1)

    def eos_ids(self) -> set[int]:
        """End-of-sequence ids: the model config's and the tokenizer's."""
        ids = set(self.model.cfg.eos_token_ids)
        if self.tokenizer is not None:
            ids |= self.tokenizer.eos_ids
        return ids


