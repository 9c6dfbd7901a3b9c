"""Adaptive speculation in continuous batching: whether the batch's sequences draft this step.

A batched step's cost depends on every sequence in it, so the one-sequence controller's cost model (a plain step
plus a cost per verification row, `adaptive.StepCosts`) does not carry over; what a batch can measure is the rate at
which its decode steps emit tokens. `DraftGate` keeps a running rate (tokens per second over decode-only steps) for
steps where the sequences draft and for steps where they do not, and drafts while drafting steps emit at least as
fast. Each mode's rate is kept current by a step of the other mode every `interval` steps: the first plain one after
FIRST steps, then one every PROBE while drafting (a plain step costs at most what drafting gains over it), and while
drafting does not pay a drafting step at intervals doubling up to PROBE_MAX. Such a step weighs more in its mode's
running rate (PROBE_RATE against RATE), which is older. A model small enough to be bound by its arithmetic at the
batch's rows (the bundled ones on 2 cores) pays for every draft row what it would save, and turns drafting off; a
model bound by memory bandwidth keeps it.

Skipping a draft changes no token: verification is lossless and the drafters are told every committed token.
"""

from __future__ import annotations

PROBE = 16  # while drafting, every PROBE-th decode step is plain
FIRST = 4  # the first plain step: soon, so that a batch where drafting does not pay stops early
PROBE_MAX = 256  # while not, a drafting step every `interval` steps, the interval doubling up to this
RATE = 0.25  # share of a new step's rate in the running one (the machine's step times are noisy)
PROBE_RATE = 0.5  # the same for a step of the other mode: rarer, and its running rate older
MARGIN = 0.03  # a mode replaces the other only when its rate is this much higher


class DraftGate:
    def __init__(self) -> None:
        self.on = True  # drafting, until plain steps are measured to emit faster
        self.rate: dict[bool, float] = {True: 0.0, False: 0.0}  # tokens per second (0: not measured yet)
        self.interval = FIRST  # then PROBE
        self._since = 0  # decode steps since the last step of the other mode

    def draft(self) -> bool:
        """Whether the sequences draft in the next step."""
        self._since += 1
        if self._since < self.interval:
            return self.on
        self._since = 0
        return not self.on

    def observe(self, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode-only step (no prompt chunks in it) emitted `tokens` in `seconds`, drafting or not."""
        if tokens <= 0 or seconds <= 0.0:
            return
        r, old = tokens / seconds, self.rate[drafted]
        share = RATE if drafted == self.on else PROBE_RATE
        self.rate[drafted] = r if old == 0.0 else old + share * (r - old)
        d, p = self.rate[True], self.rate[False]
        if not (d and p):
            return
        self.interval = max(self.interval, PROBE)
        if self.on and d < p * (1 - MARGIN):
            self.on = False
        elif not self.on and d > p * (1 + MARGIN):
            self.on, self.interval = True, PROBE
        elif not self.on and drafted:  # a drafting step that did not pay: try again later
            self.interval = min(2 * self.interval, PROBE_MAX)
