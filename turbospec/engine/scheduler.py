"""Continuous batching: many sequences share one forward per step over a paged KV pool.

A `Sequence` is one request's state (tokens, sampler, block table, text and stats). `Scheduler.step()` picks the
rows of the next forward — one decode row for every running sequence past its prompt, then prompt chunks of
running and newly admitted sequences up to the token budget (`ubatch`) — runs the model once over all of them,
samples, and returns what each sequence produced. Admission needs free blocks for the whole remaining prompt;
when a running sequence cannot grow, the most recently admitted one is preempted (its blocks freed, recomputed
from its tokens later, as vLLM does). `abort()` marks a sequence; its blocks are freed at the next step and it is
never computed again.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from turbospec.engine.stats import Chunk, GenStats
from turbospec.engine.stops import TextStream
from turbospec.errors import TurboSpecError
from turbospec.kv.paged import BlockPool, Key, PagedBatch, PagedSequence, Segment, pool_for
from turbospec.kv.plan import AttentionPlan
from turbospec.kv.slot_file import SlotData, check_fields
from turbospec.kv.state_pool import HybridBatch, StatePool
from turbospec.layers.linear import batch_products
from turbospec.sampling import Sampler, SamplingParams, TokenLogprob, argmax_rows, logprobs_of
from turbospec.speculative.batch_gate import DraftGate
from turbospec.speculative.drafter import Drafter, propose_all
from turbospec.speculative.stats import SpecStats
from turbospec.speculative.tree import DraftTree
from turbospec.speculative.verify import verify
from turbospec.tokens import common_prefix

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
NOT_BATCHED = ("draft-model", "medusa")  # drafters that load weights of their own: one per sequence is too many


@dataclass(eq=False)
class Sequence:
    id: int
    prompt_len: int
    tokens: list[int]  # prompt + generated; the KV of tokens[:cache.length] is in the pool
    params: SamplingParams
    sampler: Sampler
    cache: PagedSequence
    text: TextStream
    status: str = WAITING
    stats: GenStats = field(default_factory=GenStats)
    arrived: float = field(default_factory=time.perf_counter)
    aborted: bool = False
    prompt_logprobs: list[TokenLogprob] | None = None  # collected chunk by chunk when asked for
    keys: list = field(default_factory=list)  # prefix-cache keys of its full blocks, computed as they fill
    t_first: float | None = None
    slot: int | None = None  # hybrid models: its recurrent-state slot while running
    drafter: Drafter | None = None  # speculation: its own drafter (begun when its prompt is computed)
    began: bool = False
    prompt_rows: list[torch.Tensor] = field(default_factory=list)  # hidden rows of the prompt's end, for begin()
    slot_id: int | None = None  # which of the `max_seqs` slots it runs in (its context is the slot's afterwards)

    @property
    def todo(self) -> int:
        """Tokens whose KV is not computed yet (1 while decoding: the last sampled token)."""
        return len(self.tokens) - self.cache.length

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status == FINISHED


@dataclass
class Hit:
    """A prompt's cached prefix: full blocks to share, then maybe the first `partial_len` positions of block
    `partial` to copy; `state`: the snapshot key of the recurrent states where it ends (hybrids)."""

    blocks: list[int]
    partial: int | None = None
    partial_len: int = 0
    state: Key | None = None


def block_keys(tokens: list[int], block: int, full: int, keys: list | None = None) -> list:
    """Keys of the first `full` blocks of tokens (extending `keys`, the ones known): each names its block's tokens
    and, by hash, everything before them."""
    keys = [] if keys is None else keys
    while len(keys) < full:
        j = len(keys)
        keys.append((hash(keys[-1]) if j else 0, tuple(tokens[j * block:(j + 1) * block])))
    return keys[:full]


def partial_key(keys: list, tokens: list[int], block: int, n: int) -> Key:
    """The key of positions [m * block, n) of a last, partly filled block (m = n // block; keys: the full ones)."""
    m = n // block
    return (hash(keys[m - 1]) if m else 0, tuple(tokens[m * block:n]))


def _common(a: tuple, b: tuple) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Output:
    """What one step produced for one sequence: a chunk (tokens and text, maybe empty) and whether it ended."""

    seq: Sequence
    chunk: Chunk | None
    finished: bool


class Scheduler:
    def __init__(self, model, pool: BlockPool, *, max_seqs: int = 8, max_step_tokens: int = 512, ctx: int = 4096,
                 tokenizer=None, eos: set[int] | None = None, prefix_cache: bool = True,
                 states: StatePool | None = None, drafters: Callable[[int], Drafter] | None = None, n_max: int = 3,
                 adaptive: bool = False):
        if max_seqs < 1 or max_step_tokens < 1:
            raise TurboSpecError("the scheduler needs at least one sequence and one token per step")
        self.model, self.pool, self.tokenizer = model, pool, tokenizer
        self.max_seqs, self.max_step_tokens, self.ctx = max_seqs, max_step_tokens, ctx
        self.eos = set(eos or ())
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
        self.preemptions = 0
        self.steps = 0
        self._promised = 0  # blocks the rows scheduled so far in this step will allocate
        self.prefix_cache = prefix_cache
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of them, found cached
        # hybrid models: recurrent states per running sequence (and prefix snapshots at block boundaries)
        self.states = states
        # speculation: a new drafter per sequence (for its longest length); drafts at most n_max tokens deep
        self.drafters, self.n_max = drafters, n_max
        # adaptive speculation (--spec-adaptive): the sequences draft while drafting steps emit tokens faster
        self.gate = DraftGate() if drafters is not None and adaptive else None
        # tensor parallelism: this rank's decisions of a step (ints) -> rank 0's (turbospec.parallel.tp.rank0_ints)
        self.agree: Callable[[list[int]], list[int]] | None = None
        # drafters of finished sequences whose tables follow the tokens (model-free ones), with the tokens they hold:
        # a request that continues one (a conversation's next turn) takes it over instead of indexing its whole
        # prompt again (at 64K tokens prompt lookup took 65 ms, the suffix index 230 ms, inside a step the batch
        # waits for); at most `max_seqs` of them, holding at most `ctx` tokens together
        self._spare: list[tuple[list[int], Drafter]] = []
        # slots (llama-server's): a running sequence holds one; the context of the last one to finish in it stays
        # the slot's (its blocks in the prefix cache) for /slots save and restore
        self.slot_tokens: list[list[int]] = [[] for _ in range(max_seqs)]
        self._free_slot_ids = list(range(max_seqs - 1, -1, -1))
        if states is not None and states.num_slots < max_seqs:
            raise TurboSpecError(f"{states.num_slots} recurrent-state slots for {max_seqs} sequences")

    @classmethod
    def for_engine(cls, engine, parallel: int) -> Scheduler:
        """A scheduler over `engine`'s model, tokenizer and settings: a KV pool of `ctx` positions (or of
        `cache_mem` MiB) in its KV formats, `parallel` sequences at most, `ubatch` tokens per step; on hybrids a
        recurrent-state slot per sequence and `ctx_checkpoints` snapshots per sequence. One-line errors for what it
        cannot run yet."""
        from turbospec.model.dense import DenseModel
        from turbospec.model.hybrid import HybridModel

        c, model = engine.config, engine.model
        if not isinstance(model, (DenseModel, HybridModel)):
            raise TurboSpecError(f"--parallel {parallel}: continuous batching runs dense and hybrid models, not "
                                 f"{model.cfg.arch}; use --parallel 1")
        drafters = None
        if c.spec.enabled:
            later = [t for t in c.spec.types if t in NOT_BATCHED]
            if later:
                raise TurboSpecError(f"--parallel {parallel}: --spec-type {later[0]} is not batched yet (n-gram "
                                     "drafters and draft-mtp are); use --parallel 1 for it")
            from turbospec.speculative.registry import make_drafter, new_store

            store = new_store(c.spec)  # --spec-suffix-shared: one store of earlier requests for all sequences

            def drafters(max_len: int) -> Drafter:
                d = make_drafter(c.spec, model, max_len, model_path=engine.model_path, store=store)
                assert d is not None
                return d
        states = None
        if isinstance(model, HybridModel):
            snapshots = c.ctx_checkpoints * parallel if c.prefix_cache else 0
            states = model.new_state_pool(parallel, snapshots, per_owner=c.ctx_checkpoints)
        pool = pool_for(model, c.ctx, c.cache_type_k, c.cache_type_v, mem=c.cache_mem,
                        layers=model.num_attn_layers if isinstance(model, HybridModel) else model.cfg.num_layers,
                        reserved=states.nbytes if states is not None else 0)
        return cls(model, pool, max_seqs=parallel, max_step_tokens=c.ubatch, ctx=c.ctx,
                   tokenizer=engine.tokenizer, eos=engine.eos_ids(), prefix_cache=c.prefix_cache, states=states,
                   drafters=drafters, n_max=c.spec.depth, adaptive=c.spec.adaptive)

    # ---- requests -------------------------------------------------------------------------------------
    def add(self, tokens: list[int], params: SamplingParams | None = None) -> Sequence:
        params = params or SamplingParams()
        if not tokens:
            raise TurboSpecError("empty prompt")
        limit = min(self.ctx, self.pool.num_blocks * self.pool.block)
        if len(tokens) + params.max_tokens > limit:
            raise TurboSpecError(f"prompt ({len(tokens)} tokens) + max_tokens ({params.max_tokens}) exceeds context "
                                 f"size {limit}")
        vocab = self.model.cfg.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise TurboSpecError(f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary "
                                 f"[0, {vocab})")
        sampler = Sampler(params)
        sampler.accept(tokens)
        seq = Sequence(next(self._ids), len(tokens), list(tokens), params, sampler, PagedSequence(self.pool, limit),
                       TextStream(self.tokenizer, params.stop))
        seq.stats.prompt_tokens = len(tokens)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = []
        if self.drafters is not None:
            seq.drafter = self._new_drafter(seq)
            seq.stats.spec = SpecStats()
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop a sequence: it is dropped (and its blocks freed) at the next step."""
        seq.aborted = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------------------
    def step(self) -> list[Output]:
        """Schedule, run one forward over every scheduled row, sample; the outputs of this step."""
        outputs = self._drop_aborted()
        t0 = time.perf_counter()
        # (the gate counts the steps with decode rows)
        drafting = self.gate.draft() if self.gate is not None and any(s.todo == 1 for s in self.running) else True
        if self.gate is not None and self.agree is not None:  # rank 0's choice: each rank timed its own steps
            drafting = bool(self.agree([int(drafting)])[0])
        while True:
            self._promised = 0
            decode = self._schedule_decode(drafting)
            chunks = self._schedule_prefill(self.max_step_tokens - sum(n for _, n, _ in decode))
            work = decode + [(s, n, None) for s, n in chunks]
            prefill = {s.id for s, _ in chunks}
            if work or not self.running:
                break
            # every running sequence is mid-prompt and none has the blocks for its next chunk (they were admitted
            # against the same free blocks): the newest one gives its blocks back
            self._preempt(self.running[-1])
        if not work:
            return outputs
        self.steps += 1
        segments, rows, ids = [], 0, []
        for s, n, tree in work:
            start = s.cache.length
            if tree is None:  # prompt chunk or plain decode row
                plan = AttentionPlan.causal(start, n)
                ids += s.tokens[start:start + n]
            else:  # the last token and its draft
                plan = (AttentionPlan.causal(start, n) if tree.is_chain
                        else AttentionPlan.tree(start, [-1] + [p + 1 for p in tree.parents]))
                ids += [s.tokens[-1], *tree.tokens]
            segments.append(Segment(s.cache, rows, n, plan))
            rows += n
        paged = PagedBatch(self.pool, segments)
        batch = paged if self.states is None else HybridBatch(paged, self.states, [s.slot for s, _, _ in work])  # type: ignore[misc]
        with batch_products():
            hidden = self.model.forward(torch.tensor(ids, dtype=torch.int64), batch.plan, batch)
            # logits: every row of a verification step, the last row of a prompt that ends or of a decode row
            wanted = [list(range(seg.row, seg.row + seg.n)) if tree is not None
                      else [seg.row + n - 1] if s.cache.length + n == len(s.tokens) else []
                      for (s, n, tree), seg in zip(work, segments)]
            flat = [r for w in wanted for r in w]
            # (every row wanted, as in a step of decode rows: the rows themselves, not a gathered copy)
            logits = self.model.logits(hidden if len(flat) == hidden.shape[0] else hidden[flat]) if flat else None
        decided = self._decide(work, wanted, logits)
        verified = {i: d for i, d in decided.items() if work[i][2] is not None}
        keeps = {i: [0] + [1 + j for j in path] for i, (path, _) in verified.items()}
        batch.commit(keeps)  # a verification's accepted path
        if self.prefix_cache:
            for s, _, _ in work:
                self._remember(s)
        for i, ((s, n, tree), seg, w) in enumerate(zip(work, segments, wanted)):
            rows_of_seq = hidden[seg.row:seg.row + n]
            if s.id in prefill:
                self._prompt_rows(s, rows_of_seq, s.cache.length - n)
            if i in verified:
                path, nxt = verified[i]
                outputs.append(self._accept(s, tree, path, nxt, rows_of_seq[keeps[i]]))  # type: ignore[arg-type]
            elif w and logits is not None:
                decoding = s.began
                if s.drafter is not None and not s.began:
                    self._begin_drafter(s)
                outputs.append(self._sample(s, decided[i][1] if i in decided else None,
                                            rows_of_seq if decoding else None))
        if self.gate is not None and decode and not prefill:  # a decode-only step: its rate of tokens
            emitted = sum(1 + len(verified[i][0]) if i in verified else 1 for i in range(len(work)))
            self.gate.observe(drafting, emitted, time.perf_counter() - t0)
        if not drafting:
            for s, _, _ in decode:
                if s.stats.spec is not None:
                    s.stats.spec.skipped += 1
        return outputs

    def _prompt_rows(self, s: Sequence, hidden: torch.Tensor, start: int) -> None:
        """A prompt chunk's rows (positions start..): prompt logprobs, and the rows the drafter's begin() reads."""
        if s.prompt_logprobs is not None and start + hidden.shape[0] <= s.prompt_len:
            self._collect_prompt_logprobs(s, hidden, start)
        d = s.drafter
        if d is not None and d.needs_hidden and not s.began:
            end = len(s.tokens)  # every token is computed before the next is sampled (a recomputed one's too)
            want = d.prompt_rows(end)
            first = 0 if want is None else max(0, end - want)
            lo = max(first, start)
            if lo < start + hidden.shape[0]:
                s.prompt_rows.append(hidden[lo - start:])

    def _begin_drafter(self, s: Sequence) -> None:
        self._take_spare(s)
        d = s.drafter
        assert d is not None
        rows = torch.cat(s.prompt_rows) if s.prompt_rows else None
        d.sampling(s.params)
        d.begin(s.tokens[:s.cache.length], rows if d.needs_hidden else None)
        s.prompt_rows = []
        s.began = True

    def _take_spare(self, s: Sequence) -> None:
        """Give `s` the kept drafter whose tokens share the longest prefix (a block at least) with its tokens."""
        if not self._spare or s.drafter is None or s.drafter.needs_hidden:
            return
        tokens = s.tokens[:s.cache.length]
        shared, i = max((common_prefix(held, tokens), i) for i, (held, _) in enumerate(self._spare))
        if shared >= self.pool.block:
            s.drafter = self._spare.pop(i)[1]

    def _keep_spare(self, tokens: list[int], d: Drafter) -> None:
        if d.needs_hidden:  # (an MTP drafter's cache is sized for its sequence; it reads a window of rows anyway)
            return
        self._spare.append((tokens, d))
        while len(self._spare) > self.max_seqs or sum(len(t) for t, _ in self._spare) > self.ctx:
            self._spare.pop(0)  # the least recently finished

    def _new_drafter(self, s: Sequence) -> Drafter:
        assert self.drafters is not None
        return self.drafters(s.prompt_len + s.params.max_tokens + self.n_max + 1)

    def _drafts(self, seqs: list[Sequence]) -> dict[int, DraftTree]:
        """The drafts to verify after each sequence's last token, by sequence id (none for a sequence without a
        drafter, or whose draft would be worth no row); the MTP drafters of the batch draft together."""
        if self.drafters is None:
            return {}
        todo: list[tuple[Sequence, int, int]] = []  # (sequence, deepest draft, rows it may take)
        for s in seqs:
            if s.drafter is None or not s.began:
                continue
            room = min(s.params.max_tokens - s.stats.gen_tokens - 1, self.n_max)
            slots = s.cache.max_len - s.cache.length - 1
            if self.states is not None:  # a hybrid keeps every node's recurrent state for at most rollback_limit rows
                slots = min(slots, self.states.rollback_limit - 1)
            if min(room, slots) > 0:
                todo.append((s, room, slots))
        with batch_products():  # (rows of several sequences in one product: as in the step's forward)
            trees = propose_all([s.drafter for s, _, _ in todo], [s.tokens for s, _, _ in todo],  # type: ignore[misc]
                                [room for _, room, _ in todo])
        out = {}
        for (s, room, slots), tree in zip(todo, trees):
            if len(tree):
                tree = tree.limit(room, slots)
            if len(tree):
                out[s.id] = tree
        return out

    def _drop_aborted(self) -> list[Output]:
        out = []
        for s in [s for s in self.running if s.aborted] + [s for s in self.waiting if s.aborted]:
            s.stats.finish_reason = "abort"
            self._finish(s)
            out.append(Output(s, None, True))
        return out

    def _need(self, s: Sequence, n: int) -> int:
        """New blocks sequence `s` needs for n more positions."""
        return max(0, self.pool.blocks_for(s.cache.length + n) - len(s.cache.blocks))

    def _available(self) -> int:
        """Blocks not yet promised to a row of the step being scheduled."""
        return self.pool.num_free - self._promised

    def _schedule_decode(self, drafting: bool = True) -> list[tuple[Sequence, int, DraftTree | None]]:
        """Running sequences past their prompt, each with room for its next row and (`drafting`) its draft's (the
        draft is dropped when its rows do not fit; then the newest sequences are preempted until one row does)."""
        decode: list[tuple[Sequence, int, DraftTree | None]] = []
        ready = [s for s in self.running if s.status == RUNNING and s.todo == 1]
        # (every ready sequence drafts first, together; one preempted below for another's rows drafted for nothing:
        # its drafter is replaced)
        drafts = self._drafts(ready) if drafting else {}
        for s in ready:
            if s.status != RUNNING:  # preempted for an earlier sequence's rows
                continue
            tree = drafts.get(s.id)
            n = 1 + (len(tree) if tree is not None else 0)
            if self._need(s, n) > self._available():
                tree, n = None, 1
            need = self._need(s, n)
            while need > self._available():
                victim = self.running[-1]
                for item in [x for x in decode if x[0] is victim]:  # scheduled already: its promise goes with it
                    decode.remove(item)
                    self._promised -= self._need(victim, item[1])
                self._preempt(victim)
                if victim is s:
                    break
            if s.status == RUNNING:
                decode.append((s, n, tree))
                self._promised += need
        return decode

    def _schedule_prefill(self, budget: int) -> list[tuple[Sequence, int]]:
        """Prompt chunks up to `budget` tokens within the blocks left: running sequences mid-prompt first, then
        newly admitted ones (their prompt's cached blocks shared, the rest of it must fit in the free blocks)."""
        chunks: list[tuple[Sequence, int]] = []
        for s in self.running:
            if budget <= 0:
                return chunks
            if s.todo > 1:
                n = self._chunk(s, budget)
                if self._need(s, n) > self._available():
                    continue
                chunks.append((s, n))
                self._promised += self._need(s, n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            s = self.waiting[0]
            hit = self._cached_prefix(s)
            cached = hit.blocks
            # sharing cached blocks takes them off the free list (the partial one's while it is copied)
            held = sum(1 for b in cached + ([hit.partial] if hit.partial is not None else []) if self.pool.refs[b] == 0)
            if self.pool.blocks_for(len(s.tokens)) - len(cached) + held > self._available():
                break  # the whole prompt must fit before it starts
            self.waiting.popleft()
            for b in cached:
                self.pool.share(b)
            s.cache.blocks = list(cached)
            s.cache.length = len(cached) * self.pool.block
            if hit.partial is not None:  # the start of a cached partial block, copied into a block of its own
                self.pool.share(hit.partial)
                own = self.pool.allocate(1)[0]
                self.pool.copy_start(hit.partial, own, hit.partial_len)
                self.pool.release([hit.partial])
                s.cache.blocks.append(own)
                s.cache.length += hit.partial_len
            if self.states is not None:
                s.slot = self.states.acquire()
                if hit.state is not None:  # resume from the recurrent states where the reused prefix ends
                    self.states.restore(hit.state, s.slot)
            if s.t_first is None:  # (a preempted sequence keeps its first admission's numbers)
                s.stats.cached_tokens = s.cache.length
                self.prefix_queries += len(s.tokens)
                self.prefix_hits += s.cache.length
            s.status = RUNNING
            s.slot_id = self._free_slot_ids.pop()
            self.running.append(s)
            n = self._chunk(s, budget)
            chunks.append((s, n))
            self._promised += self._need(s, n)
            budget -= n
        return chunks

    def _chunk(self, s: Sequence, budget: int) -> int:
        """The next prompt chunk of `s`: within the budget and, on a hybrid with the prefix cache, ending at the next
        block boundary at the latest (the recurrent states there are snapshotted)."""
        n = min(s.todo, budget)
        if self.states is not None and self.prefix_cache and self.states.max_snapshots:
            b, at = self.pool.block, s.cache.length
            n = min(n, b - at % b)
            if at < s.prompt_len - 1 < at + n:  # and before the prompt's last token (snapshotted: the same prompt
                n = s.prompt_len - 1 - at      # again resumes there)
        return n

    # ---- prefix cache ---------------------------------------------------------------------------------
    def _keys(self, s: Sequence, full: int) -> list:
        """Keys of the sequence's first `full` blocks of tokens (computed once)."""
        return block_keys(s.tokens, self.pool.block, full, s.keys)

    def _cached_prefix(self, s: Sequence) -> Hit:
        """The longest cached prefix of the prompt (at least one token is left to compute, for the next token's
        logits): shared full blocks, then the start of a cached block that continues them (copied); on hybrids it
        must end where recurrent states were snapshotted."""
        if not (self.prefix_cache and s.params.cache_prompt) or s.prompt_logprobs is not None:
            return Hit([])
        limit = len(s.tokens) - 1
        return self._find(s.tokens, limit, self._keys(s, limit // self.pool.block))

    def _find(self, tokens: list[int], limit: int, keys: list) -> Hit:
        """The longest cached prefix of tokens[:limit] (`keys`: its full blocks' keys)."""
        b = self.pool.block
        out: list[int] = []
        usable = 0  # hybrids: the last full block whose recurrent states were snapshotted
        for key in keys:
            block = self.pool.lookup(key)
            if block is None:
                break
            out.append(block)
            if self.states is None or self.states.has(key):
                usable = len(out)
        m = len(out)
        prev = hash(keys[m - 1]) if m else 0
        want = tuple(tokens[m * b:min(limit, (m + 1) * b - 1)])
        best = Hit(out[:usable], state=keys[usable - 1] if usable and self.states is not None else None)
        for block, toks in self.pool.children(prev):
            r = _common(toks, want)
            if self.states is not None:  # the longest snapshotted prefix of those r tokens
                r = max((len(t) for p, t in self.states.snapshot_keys() if p == prev and len(t) <= r and t == want[:len(t)]),
                        default=0)
            if r and m * b + r > len(best.blocks) * b + best.partial_len:
                best = Hit(out, block, r, (prev, want[:r]) if self.states is not None else None)
        return best

    def _partial_key(self, s: Sequence) -> Key | None:
        """The key of the sequence's committed positions in its last, partly filled block (None: no such block)."""
        m, r = divmod(s.cache.length, self.pool.block)
        return partial_key(self._keys(s, m), s.tokens, self.pool.block, s.cache.length) if r else None

    # ---- slots: save / restore / erase (between steps) ------------------------------------------------------
    def slot_data(self, i: int) -> SlotData:
        """Slot i's context as far as the prefix cache still holds it (and, on hybrids, recurrent states there)."""
        self.check_slot(i)
        tokens, b = self.slot_tokens[i], self.pool.block
        hit = self._find(tokens, len(tokens), block_keys(tokens, b, len(tokens) // b))
        n = len(hit.blocks) * b + hit.partial_len
        if not n:
            raise TurboSpecError(f"slot {i} holds no cached context")
        pos = [blk * b + j for blk in hit.blocks for j in range(b)]
        pos += [hit.partial * b + j for j in range(hit.partial_len)] if hit.partial is not None else []
        idx = torch.tensor(pos, dtype=torch.int64)
        data = SlotData(tokens[:n], {f: t.index_select(2, idx) for f, t in self.pool.k.items()},
                        {f: t.index_select(2, idx) for f, t in self.pool.v.items()})
        if self.states is not None:
            assert hit.state is not None
            conv, ssm = self.states.states_of(hit.state)
            data.conv, data.ssm = torch.stack(conv), torch.stack(ssm)
        return data

    def load_slot(self, i: int, data: SlotData) -> None:
        """Put a saved context into the prefix cache as slot i's: a prompt that starts with it resumes after it."""
        self.check_slot(i)
        check_fields(data, self.pool.k, self.pool.v)
        pool, b, n = self.pool, self.pool.block, len(data.tokens)
        if n > min(self.ctx, pool.num_blocks * b):
            raise TurboSpecError(f"the slot file holds {n} positions, more than the context size")
        if self.states is not None and (data.conv is None or data.ssm is None):
            raise TurboSpecError("the slot file has no recurrent states")
        m, r = divmod(n, b)
        if m + bool(r) > pool.num_free - self._promised:
            raise TurboSpecError(f"no room for {n} positions in the KV pool now (busy; try again)")
        blocks = pool.allocate(m + bool(r))
        pos = torch.arange(n, dtype=torch.int64)
        idx = torch.tensor(blocks, dtype=torch.int64)[pos // b] * b + pos % b
        for mine, got in ((pool.k, data.k), (pool.v, data.v)):
            for f, t in mine.items():
                t.index_copy_(2, idx, got[f].to(t.dtype))
        keys = block_keys(data.tokens, b, m)
        for j in range(m):
            pool.remember(blocks[j], keys[j])
        last = partial_key(keys, data.tokens, b, n) if r else keys[-1]
        if r:
            pool.remember(blocks[m], last)
        if self.states is not None and data.conv is not None and data.ssm is not None:
            self.states.put(last, ([c.to(self.states.dtype).clone() for c in data.conv],
                                   [s.float().clone() for s in data.ssm]))
        pool.release(blocks)  # cached, held by no one
        self.slot_tokens[i] = list(data.tokens)

    def erase_slot(self, i: int) -> int:
        """Forget slot i's context (its blocks stay in the prefix cache until evicted); the tokens it had."""
        self.check_slot(i)
        n, self.slot_tokens[i] = len(self.slot_tokens[i]), []
        return n

    def check_slot(self, i: int) -> None:
        if not 0 <= i < self.max_seqs:
            raise TurboSpecError(f"slot {i} does not exist (0..{self.max_seqs - 1}, -np)")

    def _remember(self, s: Sequence) -> None:
        """Offer the sequence's newly filled blocks to the prefix cache."""
        full = s.cache.length // self.pool.block
        keys = self._keys(s, full)
        for j, key in enumerate(keys):
            self.pool.remember(s.cache.blocks[j], key)
        if self.states is None or s.slot is None:
            return
        if full and s.cache.length % self.pool.block == 0:
            self.states.snapshot(keys[-1], s.slot, s.id)  # (a no-op when it has this one)
        elif s.cache.length == s.prompt_len - 1:  # before the prompt's last token: where the same prompt again, or
            # a follow-up that re-tokenized the answer differently, resumes
            key = self._partial_key(s)
            if key is not None:
                self.states.snapshot(key, s.slot, s.id)

    def _preempt(self, s: Sequence) -> None:
        """Free a running sequence's blocks; it waits (first in line) and recomputes its tokens when readmitted."""
        self.running.remove(s)
        s.cache.reset()
        self._release_slots(s)
        s.status = WAITING
        if s.drafter is not None:  # begun again when its tokens are recomputed
            s.drafter, s.began, s.prompt_rows = self._new_drafter(s), False, []
        if s.prompt_logprobs:  # collected again from the start
            s.prompt_logprobs = []
        self.waiting.appendleft(s)
        self.preemptions += 1

    def _finish(self, s: Sequence) -> None:
        if s in self.running:
            self.running.remove(s)
        elif s in self.waiting:
            self.waiting.remove(s)
        key = self._partial_key(s) if self.prefix_cache and s.params.cache_prompt else None
        if key is not None:  # its last, partly filled block stays cached (and, on hybrids, the states there)
            self.pool.remember(s.cache.blocks[-1], key)
            if self.states is not None and s.slot is not None:
                self.states.snapshot(key, s.slot, s.id)
        done = s.tokens[:s.cache.length]  # (one copy for the slot, the drafter and the kept drafter: none changes it)
        if s.slot_id is not None:  # its context becomes the slot's
            self.slot_tokens[s.slot_id] = done
        if s.drafter is not None:
            s.drafter.finish(done)
            if s.began and s.status == RUNNING:  # (not one that never started: aborted while waiting)
                self._keep_spare(done, s.drafter)
        s.cache.reset()
        self._release_slots(s)
        s.status = FINISHED
        now = time.perf_counter()
        if s.t_first is not None:
            s.stats.decode_s = now - s.t_first
        elif not s.stats.prefill_s:
            s.stats.prefill_s = now - s.arrived

    def _release_slots(self, s: Sequence) -> None:
        """A sequence leaves the running set: its slot (id) and, on hybrids, its recurrent-state slot are free."""
        if self.states is not None and s.slot is not None:
            self.states.release(s.slot)
            s.slot = None
        if s.slot_id is not None:
            self._free_slot_ids.append(s.slot_id)
            self._free_slot_ids.sort(reverse=True)
            s.slot_id = None

    def _collect_prompt_logprobs(self, s: Sequence, hidden: torch.Tensor, start: int) -> None:
        """Logprobs of the prompt tokens after positions [start, start + rows) (raw logits), 64 rows at a time."""
        k, got = s.params.prompt_logprobs, s.prompt_logprobs
        if k is None or got is None:
            return
        end = min(start + hidden.shape[0], s.prompt_len - 1)
        for a in range(start, end, 64):
            b = min(a + 64, end)
            got += logprobs_of(self.model.logits(hidden[a - start:b - start]), s.tokens[a + 1:b + 1], k)

    @staticmethod
    def _greedy_tokens(work, wanted: list[list[int]], logits: torch.Tensor | None) -> dict[int, int]:
        """logits row -> token for the rows sampled one per sequence (decode rows, prompts' last rows) whose
        samplers are plain greedy: one argmax call for all of them instead of one per sequence."""
        picks, at = [], 0
        for (s, _, tree), w in zip(work, wanted):
            if tree is None and w and s.sampler.plain_greedy:
                picks.append(at)
            at += len(w)
        if logits is None or len(picks) < 2:
            return {}
        every = len(picks) == logits.shape[0]  # all rows (a decode step): no gathered copy
        return dict(zip(picks, argmax_rows(logits if every else logits[picks])))

    def _decide(self, work, wanted: list[list[int]], logits: torch.Tensor | None) -> dict[int, tuple[list[int], int]]:
        """Work item -> (accepted draft nodes, next token) for every item whose rows have logits: a verification's
        path and the token after it, a decode row's or a prompt's last row's sampled token (none for a request of
        max_tokens 0, which ends at its first token). Under tensor parallelism (`agree`) every rank takes rank 0's
        decisions, its samplers' penalty windows set to match."""
        decided: dict[int, tuple[list[int], int]] = {}
        if logits is None:
            return decided
        greedy = self._greedy_tokens(work, wanted, logits)
        windows: dict[int, list[int]] = {}
        at = 0
        for i, ((s, _, tree), w) in enumerate(zip(work, wanted)):
            if w and self.agree is not None:
                windows[i] = s.sampler.window
            if tree is not None:
                decided[i] = verify(tree, logits[at:at + len(w)], s.sampler)
            elif w and not (s.t_first is None and s.params.max_tokens == 0):
                tok = greedy.get(at)
                decided[i] = ([], s.sampler.sample(logits[at]) if tok is None else s.sampler.took(tok))
            at += len(w)
        if self.agree is None or not decided:
            return decided
        got = self.agree([v for path, nxt in decided.values() for v in (len(path), nxt, *path)])
        at = 0
        for i, mine in decided.items():
            n = got[at]
            theirs = (got[at + 2:at + 2 + n], got[at + 1])
            at += 2 + n
            if theirs != mine:
                s, _, tree = work[i]
                decided[i] = theirs
                s.sampler.window = windows[i]
                s.sampler.accept([tree.tokens[j] for j in theirs[0]] + [theirs[1]] if tree is not None
                                 else [theirs[1]])
        return decided

    def _sample(self, s: Sequence, tok: int | None, row: torch.Tensor | None = None) -> Output:
        """The sequence's sampled next token (`_decide`; None: none, for max_tokens 0): apply the stop rules, and say
        what goes out (`row`: the hidden row of a decode step, which the sequence's drafter is told with the token,
        as after a verification)."""
        st, params = s.stats, s.params
        now = time.perf_counter()
        first = s.t_first is None
        prompt_lp = None
        if first:
            st.prefill_s = now - s.arrived
            if s.prompt_logprobs is not None:
                prompt_lp = [None, *s.prompt_logprobs]
                s.prompt_logprobs = None
            if params.max_tokens == 0:
                st.finish_reason = "length"
                self._finish(s)
                return Output(s, Chunk([], "", prompt_logprobs=prompt_lp) if prompt_lp else None, True)
        assert tok is not None
        if first:
            s.t_first = now
            st.ttft_s = now - s.arrived
        if row is not None and s.drafter is not None:
            s.drafter.accept([s.tokens[-1]], row if s.drafter.needs_hidden else None, tok)
        return self._emit(s, [tok], prompt_lp)

    def _accept(self, s: Sequence, tree: DraftTree, path: list[int], nxt: int, hidden: torch.Tensor) -> Output:
        """After a verification step: the drafter learns what was accepted; the accepted tokens and the next one
        go out (stop rules token by token)."""
        accepted = [tree.tokens[i] for i in path]
        assert s.drafter is not None and s.stats.spec is not None
        s.stats.spec.record(tree, len(path))
        s.drafter.accept([s.tokens[-1]] + accepted, hidden if s.drafter.needs_hidden else None, nxt)
        return self._emit(s, accepted + [nxt], None)

    def _emit(self, s: Sequence, toks: list[int], prompt_lp: list | None) -> Output:
        """Append sampled tokens and apply the stop rules to each: what goes out, and whether the sequence ended."""
        st, params = s.stats, s.params
        lps = s.sampler.take_logprobs() if params.logprobs is not None else None
        out: list[int] = []
        text, reason = "", None
        for tok in toks:
            st.gen_tokens += 1
            s.tokens.append(tok)
            if tok in self.eos and not params.ignore_eos:
                reason = "stop"
                break
            piece, stopped = s.text.push(tok)
            text += piece
            if stopped:
                reason = "stop"
                if piece:
                    out.append(tok)
                break
            out.append(tok)
            if st.gen_tokens >= params.max_tokens:
                reason = "length"
                break
        if reason is None and s.cache.length + 1 >= s.cache.max_len:
            reason = "length"
        lp = lps[:len(out)] if lps is not None and out else None
        chunk = Chunk(out, text, lp, prompt_lp) if out or text or prompt_lp else None
        if reason is None:
            return Output(s, chunk, False)
        held = s.text.flush()  # text held back for a stop string that did not come
        if held:
            chunk = chunk or Chunk([], "")
            chunk.text += held
        st.finish_reason = reason
        self._finish(s)
        return Output(s, chunk, True)
