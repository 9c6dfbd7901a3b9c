"""Adaptive speculation: each step, the draft length (0: no draft) that maximises expected tokens per second.

Cost model (`StepCosts`): a target step over 1 + k rows costs plain + k x row, where plain is the running time of
the plain steps measured at about the current depth and row the running (verification time - plain) / k of the
verifications (at depth a verification row costs more: attention over the whole context), both starting from the
times calibrated at start-up on a scratch cache (`calibrate`), a row at a new depth growing as the plain step did
until one is measured there; a drafted token costs the running mean of the drafts' times. Acceptance (`Controller`):
per draft position, a running estimate of the chance that the target accepts it once the positions before it were
accepted. Expected tokens of a k-token draft:
E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j, at cost T(k) = plain + k x (row + draft); the step takes the k with the best
E(k) / T(k), and k = 0 (a plain step) when nothing beats 1 / T(0). A choice changes only for a gain of at least 3%
(the machine's step times are noisy) -- except to a plain step, taken as soon as it is expected to beat the draft --
and a shorter draft is taken only when it beats every longer one by 10%.
A row cost pushed far above the calibrated one (RECHECK times it: a run of slow verifications on a busy machine)
would keep drafting off for good, as nothing verifies while it is off: once FIRST_HITS of a request's probes hit
where drafting would pay at the calibrated cost but not at the running one, one 1-token draft is verified to measure
the row again (`StepCosts.recheck`: it can only lower the cost).

While drafting is off the estimates cannot learn, so the controller probes: every `probe` steps the drafter drafts
one token and the engine takes a plain step anyway, comparing its token with the draft (`shadow`: the probe costs a
draft, not a verification row), the interval doubling (up to 256) each time a probe misses (or hits while
drafting would still not pay at the acceptance seen) and back to the minimum when one hits and drafting would pay
-- and 256 whatever the hits while the costs say that no draft could pay even if every token were accepted (a model
small enough to sit in the cache: its verification rows and drafts cost what they save); probes are also spaced so
that their timed cost is at most PROBE_SHARE of what drafting could at best gain over the plain steps between them
(`StepCosts.gain_bound`: the speed-up if every drafted token were accepted). Between probes the steps are `idle`:
the engine takes them without asking the controller or timing them, and the choice is worked out again every READ
steps; with fewer than PROBE_MIN tokens left in the request, no probe is made. A request's first drafts are
probes until FIRST_HITS of them hit: FIRST_PROBES of them, or FIRST_PROBES_HIT once one hit (one token each, checked
against a plain step), made whatever the estimates say where drafts would pay at the prior and at the lower of the
running and calibrated row costs (one miss halves the prior's estimate) -- the prior's optimism costs drafts but no
verification rows; if they end with fewer than FIRST_HITS hits, the probe interval doubles once. Once MISS_STREAK
verified drafts in a row missed at their first token, the drafts the estimate still asks for are probes until one
hits (a run of hits that ended costs drafts then, not verification rows, while the estimate falls); and a request's
verified drafts are FIRST_VERIFIED_DEPTH (1) token deep until one of their tokens is accepted (the probes' hits can be
chance: a deep draft that misses costs a row per token). A position that a verified draft did not reach forgets its
counts at the rate a reached one does, so its estimate drifts back to the one before it: a deeper draft that missed a
few times early is tried again once the first positions keep hitting, not only at the EXPLORE-th steps. And while
drafting, every `EXPLORE`-th step drafts one token deeper than the best, so a deeper draft that started to pay is
found, and every second of those is a plain step instead, as is a request's first step, and its second when the plain
cost is stale (the context moved by a quarter and 512 since it was timed) or rests on one step: a plain step's cost
grows with the context (attention) differently from a verification's, so it is measured, not scaled. The drafter keeps
up meanwhile from the tokens it is told (`Drafter.accept`), so a probe drafts from a current state.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from turbospec import device
from turbospec.speculative.tree import DraftTree

PRIOR = 0.8  # acceptance assumed at a position before any evidence (MTP on the bundled models: 0.6-0.9)
RATE = 0.15  # the running acceptance counts forget this share per observation (a memory of ~7 drafts)
WEIGHT = 1.0  # pseudo-observations of the prior (or of the position before) in each position's estimate
PROBE_MIN, PROBE_MAX = 8, 256
READ = 32  # while drafting is off, the choice is worked out again (with the plain cost read) every READ steps
EXPLORE = 16
# until FIRST_HITS of a request's drafts hit, its first drafts (asked for on the prior's optimism) are probes: after
# this many the estimates rest mostly on evidence, and a draft they still ask for is verified (where rows are cheap
# enough that drafts pay at low acceptance, only verification gains anything -- and it measures a row's cost at this
# depth). One hit is mostly the prior: after a random 4K context the explain prompt's first token was drafted by
# chance, then a 3-deep and three 1-deep verified drafts missed (~1.7% of its decoding). Where one of the first
# FIRST_PROBES hit (and fewer than FIRST_HITS), up to FIRST_PROBES_HIT are made: after one chance hit and two misses
# the estimate (0.43, mostly the prior) still asked for verified drafts, each missing
FIRST_PROBES = 3
FIRST_PROBES_HIT = 5
FIRST_HITS = 2
# after this many verified drafts in a row missed at their first token, the drafts the estimate still asks for are
# probes until one hits: the running estimate remembers ~7 drafts, and where a run of hits ended (the random prompt's
# output after 3K of random context drafted its 5th-8th tokens, then nothing) or was chance (explain after 6K: its
# first two tokens), it asked for 6-7 more verified drafts, each missing, before it fell to the break-even (~0.3-0.45
# at 3-6K): their rows cost ~1-1.5% of the request. A probe costs the draft but not the row, and a hit verifies again
MISS_STREAK = 2
# a request's verified drafts are at most this deep until one of their tokens is accepted: its probes' hits can be
# chance (explain after 6K of random context: its first two tokens), and a 3-deep verified draft that misses costs 3
# rows where a 1-deep one costs 1; where drafts hit, the first verified one does and the next goes deep
FIRST_VERIFIED_DEPTH = 1
RECHECK = 1.5  # a running row cost this many times the calibrated one (grown as the plain step) is checked again
HYSTERESIS = 0.03
# a shorter draft is taken only when it beats every longer one by this much: the later positions' acceptance, learnt
# only from drafts that reach them, runs below the truth (once the first tokens are accepted the later ones are
# more often), and on the bundled model always drafting n-max beat the unbiased choice at 8K by 8-15%
DEEP_BIAS = 0.10
PLAIN_RATE = 0.3  # share of a new plain step's time in the running plain cost (plain steps are rare while drafting,
# and the machine's speed drifts between requests: a memory of ~3 steps)
ROW_RATE = 0.1  # share of a new verification's per-row cost in the running one (a memory of ~10 steps)
STALE_SHARE, STALE_MIN = 0.25, 512  # the plain cost is re-measured once the context moved by this much
# probes cost at most this share of what drafting could at best gain over the plain steps between them (up to
# PROBE_FLOOR_MAX steps apart): a probe (the drafter catching up on the last positions and drafting a token) took
# 0.6-1.3 ms on a 6 MB model whose plain step takes ~0.3 ms and whose drafts could at best gain 6% -- at 8 steps apart,
# a third of decoding; where drafts could double the speed (the default model at 8K) probes stay 8 steps apart
PROBE_SHARE, PROBE_FLOOR_MAX = 0.1, 1024


@dataclass
class StepCosts:
    """T(k) = plain + k x (row + draft): the target's plain step at the current depth, plus per draft token one
    verification row and one drafted token.

    `verify` (calibrated at start-up on a short scratch context) gives the first plain and row costs. Then `plain`
    follows the measured plain steps (a request's first step is one, and its second when the context moved since
    the last, see `plain_is_stale`), and `row` the measured verifications: (verify time - plain) / k. A
    verification row's cost grows with the context (its attention) differently from a plain step's, and rows are
    read against the plain step at about the same depth: a deep context's row is measured there, not extrapolated
    from a shallow calibration -- until the first verification there, it is taken to have grown as the plain step
    did (on the bundled model at 8K: 0.75 ms from the calibration's 0.1 ms, where the rows measure 1.1-2 ms; at
    0.1 ms drafts look nearly free where none hits)."""

    verify: list[float]  # verify[k]: seconds of a target step over 1 + k rows (calibrated)
    draft: float = 0.0  # seconds per drafted token
    plain: float = -1.0  # seconds of a plain step at about `plain_depth` positions (-1: verify[0])
    row: float = -1.0  # seconds per verification row beyond the first (-1: from `verify`)
    plain_depth: int = -1  # context length at the last measured plain step (-1: none yet)
    probe: float = 0.0  # seconds of the drafting in a probe (running; 0: none timed yet)
    draft_prior: int = 0  # observations the starting `draft` stands for (1: timed at start-up, see `calibrate`)
    _plain_obs: int = 0  # plain steps timed since the plain cost was set at a new depth
    _row_obs: int = 0  # verifications read since then
    _draft_obs: int = -1  # (the first draft also catches the drafter up with the prompt: not counted)
    _row_cal: float = field(default=0.0, init=False)  # the row cost `verify` gives
    _rechecked: float = field(default=0.0, init=False)  # the row cost before a `recheck` (0: none pending)

    def __post_init__(self) -> None:
        n = len(self.verify) - 1
        self._row_cal = max(0.0, (self.verify[-1] - self.verify[0]) / n) if n else 0.0
        if self.plain < 0:
            self.plain = self.verify[0]
        if self.row < 0:
            self.row = self._row_cal

    @property
    def reference_row(self) -> float:
        """The calibrated row cost, grown as the plain step has since (what `row` would be if the verifications
        since had measured what the calibration did)."""
        return self._row_cal * self.plain / self.verify[0] if self.verify[0] > 0 else self._row_cal

    def pushed_up(self) -> bool:
        """Whether the running row cost is RECHECK times the reference row's or more (see `Controller._recheck`)."""
        return self.row > RECHECK * self.reference_row

    def recheck(self) -> None:
        """The next verification sets the row cost, if lower than the running one (one slow verification does not
        push it further up: that takes several, as usual), instead of moving it by ROW_RATE."""
        self._rechecked = self.row
        self._row_obs = 0

    def step(self, k: int, width: int = 1, row: float = -1.0) -> float:
        """A k-deep draft of `width` candidates per depth: k x width verification rows (each `row` seconds; -1: the
        running row cost), k drafted tokens."""
        return self.plain + k * (width * (self.row if row < 0 else row) + self.draft)

    def plain_is_stale(self, depth: int) -> bool:
        """Whether the context moved enough (grown, or a new request's shorter one) since a plain step was last
        timed that its cost should be measured."""
        return self.plain_depth < 0 or abs(depth - self.plain_depth) > STALE_SHARE * self.plain_depth + STALE_MIN

    def wants_plain(self, depth: int) -> bool:
        """Whether the next step should be plain to time it: the plain cost is stale, or rests on one step."""
        return self.plain_is_stale(depth) or self._plain_obs < 2

    def observe_probe(self, draft_s: float) -> None:
        """A probe's drafter took `draft_s` seconds."""
        self.probe = draft_s if self.probe <= 0 else self.probe + PLAIN_RATE * (draft_s - self.probe)

    def gain_bound(self, room: int) -> float:
        """The speed-up over plain decoding of the best draft of at most `room` tokens if every token were accepted
        (the cost model's upper bound on what drafting can gain)."""
        return max((1.0 + k) * self.step(0) / self.step(k) for k in range(room + 1))

    def probe_interval(self, gain: float) -> int:
        """The fewest steps between probes for them to cost at most PROBE_SHARE of the `gain` (a speed-up, see
        `gain_bound`) that drafting could at best make over the plain steps between them."""
        if self.probe <= 0:
            return PROBE_MIN
        if gain <= 1.0:
            return PROBE_FLOOR_MAX
        return min(PROBE_FLOOR_MAX, int(self.probe / (PROBE_SHARE * (gain - 1.0) * self.plain)))

    def observe(self, k: int, verify_s: float, draft_s: float, depth: int = 0) -> None:
        """A step with k draft tokens after `depth` positions took `verify_s` seconds in the target and `draft_s`
        drafting. One odd step (a hiccup of the machine) moves the costs little: its time is clipped to half /
        twice the predicted one -- except a plain step at a new depth, which sets the plain cost."""
        pred = self.plain + k * self.row
        t = min(max(verify_s, pred / 2), 2 * pred)
        if k == 0:
            if self.plain_is_stale(depth):
                # rows seen at the old depth say little here: until one is measured, the row cost grows (or shrinks)
                # as the plain step did (both mostly attention over the context at depth), and the next weigh more
                self.row *= verify_s / self.plain if self.plain > 0 else 1.0
                self.plain = verify_s
                self._plain_obs, self._row_obs = 1, 0
            else:
                self._plain_obs += 1
                self.plain += max(PLAIN_RATE, 1.0 / self._plain_obs) * (t - self.plain)
            self.plain_depth = depth
            return
        self._row_obs += 1
        self.row += max(ROW_RATE, 1.0 / self._row_obs) * (max(0.0, t - self.plain) / k - self.row)
        if self._rechecked > 0:
            self.row, self._rechecked = min(self.row, self._rechecked), 0.0
        self._draft_obs += 1
        n = self._draft_obs + self.draft_prior
        if self._draft_obs > 0:
            per = draft_s / k
            if n > 1:  # one odd draft moves the cost little, as one odd verification does
                per = min(max(per, self.draft / 2), 2 * self.draft)
            self.draft += max(0.1, 1.0 / n) * (per - self.draft)


@dataclass
class Controller:
    costs: StepCosts
    n_max: int
    # per position: (running accepted, running tested) counts; the estimate leans on the position before it (or the
    # prior) while a position has few observations, so a depth never drafted yet is not assumed worse than the last
    counts: list[list[float]] = field(default_factory=list)
    probe: int = PROBE_MIN
    _since: int = 0  # steps since the last draft
    _interval: int = PROBE_MIN  # the probe interval the last worked-out choice used
    _drafted: int = 0  # verified drafted steps (every EXPLORE-th tries one token deeper than the best, every second
    # of those is a plain step instead)
    _tried: int = 0  # drafts asked for before FIRST_HITS hits, made as probes (see `choose`)
    _hits: int = 0  # drafts (probes or verified) whose first token hit
    _first: bool = False  # the last choice is one of the first drafts made a probe
    _started: int = 0  # steps of the request so far, counted up to 2
    _last: int = 0  # the length the last choice settled on
    # a probe hit where drafting would pay at the calibrated row cost but not at the running one: the next step verifies
    # a 1-token draft that sets the row cost again. With drafting off nothing else re-measures it: a row cost pushed
    # up by a run of slow verifications (0.24 -> 0.78 ms on the bundled model at depth 0, the machine busy) kept
    # drafting off for ~48 requests whose probes hit
    _recheck: bool = False
    _misses: int = 0  # verified drafts in a row whose first token missed
    _verified_hit: bool = False  # a token of one of the request's verified drafts was accepted
    off_steps: int = 0  # steps without a draft by choice (statistics)
    # steps after this one that stay plain with no choice asked (drafting is off, no probe or plain-cost reading is
    # due): the engine takes them without calling `choose` or timing them -- on a model whose step is ~0.3 ms that
    # bookkeeping, Python run between the kernels, cost ~2% of decoding
    idle: int = 0
    shadow: bool = False  # the last choice is a probe: draft 1 token, take a plain step and compare (no verify rows)
    width_max: int = 1  # the drafter's most candidates per depth (its tree width; 1: chains only)
    # per position and rank 2..width_max: running (hits, tests) of "the target took this candidate where it did not
    # take the best one" -- learnt from every greedy step, whatever width it drafted (the ranked candidates are known)
    alts: list[list[list[float]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts = [[0.0, 0.0] for _ in range(self.n_max)]
        self.alts = [[[0.0, 0.0] for _ in range(self.width_max - 1)] for _ in range(self.n_max)]

    @property
    def accept(self) -> list[float]:
        out, prior = [], PRIOR
        for a, n in self.counts:
            est = (a + WEIGHT * prior) / (n + WEIGHT)
            out.append(est)
            prior = est
        return out

    def expected(self, k: int, width: int = 1) -> list[float]:
        """Expected tokens E(0), ..., E(k) of drafts 0..k deep with `width` candidates per depth (the best one
        continued, the others leaves): at each reached position the best candidate, or else one of the others, ends
        the step's path. Width 1 (a chain): E(j) = 1 + a1 + a1 a2 + ... (j terms)."""
        out, e, p = [1.0], 1.0, 1.0
        for i, a in enumerate(self.accept[:k]):
            e += p * (a if width <= 1 else a + (1 - a) * self.alternative(i, width))
            p *= a
            out.append(e)
        return out

    def alternative(self, i: int, width: int) -> float:
        """Chance that one of candidates 2..width at position i is the target's token where the best one is not
        (no prior: until seen, alternatives are assumed never to hit)."""
        return sum(h / (n + WEIGHT) for h, n in self.alts[i][:width - 1]) if i < len(self.alts) else 0.0

    def width(self, k: int, nodes: int) -> int:
        """Candidates per depth for a k-deep draft with room for `nodes` draft nodes: the width with the best
        expected tokens per second, wider than 1 only for a gain of HYSTERESIS or more (probes: 1)."""
        if k <= 0 or self.width_max <= 1 or self.shadow:
            return 1
        one = self.expected(k)[k] / self.costs.step(k)
        best, rate = 1, one
        for w in range(2, self.width_max + 1):
            if k * w > nodes:
                break
            r = self.expected(k, w)[k] / self.costs.step(k, w)
            if r > rate:
                best, rate = w, r
        return best if rate >= one * (1 + HYSTERESIS) else 1

    def observe_alternatives(self, i: int, ranked: list[int], target: int) -> None:
        """At position i the target did not take the best candidate (ranked[0]) but `target`: which of the others
        (ranked[1:], drafted or not) it was."""
        if i >= len(self.alts):
            return
        for c, tok in zip(self.alts[i], ranked[1:]):
            c[0] = (1 - RATE) * c[0] + (1.0 if tok == target else 0.0)
            c[1] = (1 - RATE) * c[1] + 1.0

    def choose(self, room: int, depth: int = 0, left: int = -1) -> int:
        """Draft tokens to ask for this step after `depth` positions (0: a plain step), `left` tokens at most still
        to come in the request (-1: not known; with fewer than PROBE_MIN no probe is made: the drafts it could turn
        on would have no room to pay for it)."""
        room = min(room, self.n_max)
        self.shadow = self._first = False
        if self._started < 2:  # a request's first step is plain, and its second while the plain cost at about this
            self._started += 1  # depth is stale or rests on one step (it is what each row's cost is read against)
            if self._started == 1 or self.costs.wants_plain(depth):
                return 0
        if self.idle:  # (a caller that asks anyway during the idle steps)
            self.idle -= 1
            return 0
        if self._recheck and room:  # a verified 1-token draft that measures the row cost again (see `observe`)
            self._recheck = False
            self.costs.recheck()
            return 1
        rates = [e / self.costs.step(k) for k, e in enumerate(self.expected(room))]
        best = max(range(room + 1), key=lambda k: rates[k])
        if best and self._last <= room and rates[best] < rates[self._last] * (1 + HYSTERESIS):
            best = self._last  # switch only for a clear gain: the times measured on this machine are noisy -- but stop
            # drafting as soon as a plain step beats it (kept on for 3%, 1-token drafts at 0.28-0.34 estimated
            # acceptance were verified after a random 4K context, where nothing hit)
        deep = max(range(best, room + 1), key=lambda k: rates[k])  # the best draft at least as long
        if best and rates[deep] * (1 + DEEP_BIAS) >= rates[best]:
            best = deep
        self._last = best
        c = self.costs
        if room > 0 and self._first_probe() and (best or self._beats_plain(
                [sum(PRIOR ** j for j in range(k + 1)) for k in range(room + 1)], min(c.row, c.reference_row))):
            # fewer than FIRST_HITS drafts of this request hit yet: a probe, not a verification -- where nothing hits,
            # the prior's optimism costs drafts but no verification rows; where drafts hit, the first probes mostly
            # hit and the step after them goes deep. Made whatever the estimates say where drafts would pay at the
            # prior: one miss halves the estimate (at depth 0 in lockstep, drafts then looked dear: translation probed
            # 8, 16, 32 steps apart and drafted from step ~120 of 128), and a row cost pushed above the calibrated one
            # says no where it would not (if the probes hit, the next step verifies one and measures it: `_recheck`)
            self._tried += 1
            self.shadow = self._first = True
            return 1
        if best and self._misses >= MISS_STREAK:  # the last verified drafts missed: a probe, until one hits
            self.shadow = True
            return 1
        if best == 0 and room > 0:
            self._since += 1
            # look again: is drafting paying now? (a draft the plain step checks) -- unless no draft could pay even
            # if every token were accepted (drafting and verifying cost more than the plain steps they replace: a
            # small model whose weights sit in the cache), where a probe only costs; then once every PROBE_MAX steps
            gain = self.costs.gain_bound(room)
            self._interval = max(self.probe if gain >= 1 + HYSTERESIS else PROBE_MAX, self.costs.probe_interval(gain))
            if self._since >= self._interval and (left < 0 or left >= PROBE_MIN):
                self.shadow = True
                return 1
            self.off_steps += 1
            # the steps until the next probe or the next READ-th step stay plain without asking: the acceptance
            # cannot move (nothing is drafted), only the plain cost, read again at the next step that asks
            self.idle = max(0, min(self._interval - 1, -(-self._since // READ) * READ) - self._since)
            self._since += self.idle
            self.off_steps += self.idle
        elif best:
            self._drafted += 1
            if self._drafted % (2 * EXPLORE) == 0:  # a plain step now and then: the plain cost grows with the context
                return 0
            if self._drafted % EXPLORE == 0 and best < room:  # a deeper draft, now and then: does it pay now?
                return self._verified_depth(best + 1)
        return self._verified_depth(best)

    def _verified_depth(self, k: int) -> int:
        """A verified draft's depth: k, or FIRST_VERIFIED_DEPTH until a verified draft's token was accepted."""
        return k if self._verified_hit else min(k, FIRST_VERIFIED_DEPTH)

    def _first_probe(self) -> bool:
        """Whether a draft asked for now is one of the request's first ones, made a probe."""
        return self._hits < FIRST_HITS and self._tried < (FIRST_PROBES_HIT if self._hits else FIRST_PROBES)

    def _beats_plain(self, tokens: list[float], row: float = -1.0) -> bool:
        """Whether a k-token draft that gives tokens[k] tokens beats a plain step by HYSTERESIS, for some k >= 1
        (verification rows of `row` seconds; -1: the running cost)."""
        plain = 1.0 / self.costs.step(0)
        return any(tokens[k] / self.costs.step(k, row=row) >= plain * (1 + HYSTERESIS) for k in range(1, len(tokens)))

    def could_pay(self, room: int) -> bool:
        """Whether a draft of at most `room` tokens would beat a plain step by HYSTERESIS if every token were
        accepted (the cost model's upper bound on drafting's gain)."""
        return self.costs.gain_bound(room) >= 1 + HYSTERESIS

    def observe(self, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens (depth), verified or a probe, of which the first `accepted` were accepted."""
        if drafted <= 0:
            return
        # a draft after `probe` steps without one (an interval probe, or a verified draft once drafting paid again);
        # of the request's first drafts made probes, the last when fewer than FIRST_HITS of them hit: their misses
        # double the interval once (each doubling it, drafts that hit after the first tokens -- a random prompt's
        # output at 1-2K, code at 4K -- were found ~64 steps late: 1.31x instead of 1.67-1.71x)
        probing = self._since >= self.probe or (self._first and not accepted and not self._first_probe()
                                                and self._hits < FIRST_HITS)
        self._hits += accepted > 0
        if accepted:
            self._misses = 0
            self._verified_hit |= not self.shadow
        elif not self.shadow:
            self._misses += 1
        reached = min(drafted, accepted + 1, self.n_max)
        for i in range(reached):
            c = self.counts[i]
            c[0] = (1 - RATE) * c[0] + (1.0 if i < accepted else 0.0)
            c[1] = (1 - RATE) * c[1] + 1.0
        for c in self.counts[reached:]:  # not reached: the evidence ages all the same (the estimate leans on the
            c[0] *= 1 - RATE  # position before it again; kept as it was, a deep position that missed early stayed
            c[1] *= 1 - RATE  # low while the first ones hit: 1-deep drafts at 0.9 acceptance on code at depth 0)
        self._since = self.idle = 0
        c = self.costs
        if (self.shadow and accepted and self._hits >= FIRST_HITS and c.pushed_up() and not self.pays()
                and self._beats_plain(self.expected(self.n_max), c.reference_row)):
            self._recheck = True  # a probe hit, and drafting would pay but for a row cost higher than calibrated
        if probing:  # a probe: keep probing rarely while its draft misses (or hits, but drafting would still not pay
            # at the acceptance seen), often once it hits and drafting would pay
            self.probe = PROBE_MIN if accepted and self.pays() else min(PROBE_MAX, self.probe * 2)

    def pays(self) -> bool:
        """Whether some draft of up to n_max tokens beats a plain step by HYSTERESIS at the current estimates."""
        return self._beats_plain(self.expected(self.n_max))


def first_miss(tree: DraftTree, path: list[int], nxt: int, ranked: list[list[int]]) -> tuple[int, int, int]:
    """Of a greedy step over a drafter's top-k tree (`ranked[i]`: its candidates at position i, best first): (best
    candidates accepted in a row, the position where the best one was not, the target's token there); the position
    is -1 where every drafted position's best candidate was accepted. An accepted alternative (a leaf) ends the
    path: its position is the miss, its token the target's."""
    n = len(path)
    if n and n <= len(ranked) and tree.tokens[path[-1]] != ranked[n - 1][0]:
        return n - 1, n - 1, tree.tokens[path[-1]]
    if n < len(ranked) and n < max((tree.depth(i) for i in range(len(tree))), default=0):  # (depth: wide steps only)
        return n, n, nxt
    return n, -1, nxt


def calibrate(model, n_max: int, spec=None, reps: int = 5, context: int = 32) -> StepCosts:
    """Seconds of a target step over 1 + k rows, k = 0..n_max, after `context` cached positions (a scratch cache;
    1, 2 and n_max + 1 rows are timed, the others interpolated); where `spec` (a SpecConfig) drafts with the MTP,
    also a drafted token's and a probe's seconds (`time_mtp`), so that a process's first request does not take
    drafts for free."""
    from turbospec.kv.plan import AttentionPlan

    cache = model.new_cache(context + n_max + 2)
    vocab = model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (context + n_max + 1,), generator=g, device="cpu").to(torch.get_default_device())
    prompt_rows = model.forward(ids[:context], AttentionPlan.causal(0, context), cache)
    cache.commit()
    rows_timed = sorted({1, 2, n_max + 1})
    runs: dict[int, list[float]] = {r: [] for r in rows_timed}
    for rep in range(reps + 1):  # interleaved, so that the machine's drift touches every row count alike
        for rows in rows_timed:
            device.synchronize()
            t = time.perf_counter()
            model.forward(ids[context:context + rows], AttentionPlan.causal(context, rows), cache)
            model.logits(torch.zeros(rows, model.cfg.hidden_size, dtype=model.dtype))
            device.synchronize()
            if rep:  # the first round warms up
                runs[rows].append(time.perf_counter() - t)
            cache.commit([])
    timed = {rows - 1: statistics.median(ts) for rows, ts in runs.items()}
    ks = sorted(timed)
    verify = []
    for k in range(n_max + 1):
        lo = max(x for x in ks if x <= k)
        hi = min(x for x in ks if x >= k)
        verify.append(timed[lo] if hi == lo else timed[lo] + (timed[hi] - timed[lo]) * (k - lo) / (hi - lo))
    costs = StepCosts(verify)
    if spec is not None and "draft-mtp" in spec.types:
        costs.draft, costs.probe = time_mtp(model, spec, ids[:context].tolist(), prompt_rows, n_max, reps)
        costs.draft_prior = 1
    return costs


def time_mtp(model, spec, prompt: list[int], prompt_rows: torch.Tensor, n_max: int, reps: int = 5
             ) -> tuple[float, float]:
    """(seconds per drafted token of an n_max-token MTP draft, seconds of a probe: the MTP catching up on CATCH_UP
    steps and drafting one token), medians over `reps`, on a scratch MTP drafter and cache (the engine's drafter and any
    state shared between requests are left alone), after `prompt` whose target hidden rows are `prompt_rows`."""
    from dataclasses import replace

    from turbospec.sampling import SamplingParams
    from turbospec.speculative.mtp import CATCH_UP as catch_up
    from turbospec.speculative.registry import make_drafter

    context = len(prompt)
    n = context + (reps + 1) * (2 + catch_up)
    drafter = make_drafter(replace(spec, types=("draft-mtp",)), model, n + n_max + 2)
    g = torch.Generator().manual_seed(1)
    toks = prompt + torch.randint(3, model.cfg.vocab_size, (n + 1 - context,), generator=g).tolist()
    row = prompt_rows[-1:]
    drafter.sampling(SamplingParams())
    drafter.begin(prompt, prompt_rows)
    drafts: list[float] = []
    probes: list[float] = []
    pos = context  # toks[pos] is the next root
    for rep in range(reps + 1):  # (the first round warms up)
        for k, out in ((n_max, drafts), (1, probes)):
            device.synchronize()
            t = time.perf_counter()
            tree = drafter.propose(toks[:pos + 1], k)
            device.synchronize()
            if rep:
                out.append((time.perf_counter() - t) / (max(1, len(tree)) if k > 1 else 1))
            drafter.accept([toks[pos]], row, toks[pos + 1])  # a plain step after the draft
            pos += 1
            if k > 1:  # plain steps the drafter is told together, as the engine does between probes
                drafter.accept(toks[pos:pos + catch_up], row.expand(catch_up, -1), toks[pos + catch_up])
                pos += catch_up
    return statistics.median(drafts), statistics.median(probes)
