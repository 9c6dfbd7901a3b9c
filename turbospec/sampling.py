"""Token sampling: pure functions on torch tensors, and the per-sequence :class:`Sampler`.

The sampler follows llama.cpp's defaults and semantics:

* ``logit_bias`` is added first, then the penalties (repeat / presence / frequency over the last
  ``repeat_last_n`` tokens);
* then the truncation filters in llama.cpp's default chain order: top-k, top-p, min-p;
* temperature is applied last, to the surviving logits (llama.cpp's ``temperature`` sampler sits at the end of
  its default chain ``penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature``). The filters
  therefore see the untempered distribution: top-k does not care, but the top-p and min-p cut-offs would move
  if temperature were applied before them.

``temperature == 0`` means greedy: argmax with the lowest index winning ties. Any positive temperature is
applied with the row's largest logit subtracted first, so a tiny one (1e-40) gives the argmax (tied maxima
share it) instead of overflowing float32; temperatures and penalties beyond float32's range are rejected.

Logprobs (``SamplingParams.logprobs``) are ``log_softmax`` of the logits after the bias and the penalties,
before the truncation filters and temperature: the model's distribution as adjusted, not the truncated one
that is sampled.

Speculative verification (greedy and Leviathan et al. / Chen et al. rejection sampling) lives in
:func:`turbospec.speculative.verify.verify`, which draws through a :class:`Sampler`.

Cost on a CPU with a 152K vocabulary: the filters look only at the top-k (or min-p / top-p) candidates found
with ``topk`` instead of sorting the vocabulary, and draws use inverse-CDF sampling instead of
``torch.multinomial``; a default-settings draw takes a few ms where a full sort takes tens.
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from turbospec import device as compute_device
from turbospec.kernels.gemv import load_kernel

__all__ = [
    "MAX_LOGPROBS",
    "Sampler",
    "SamplingParams",
    "TokenLogprob",
    "apply_penalties",
    "draw_rows",
    "logprobs_of",
    "probs_from_logits",
    "sample",
]

MAX_LOGPROBS = 20  # the most alternatives per token that logprobs / prompt_logprobs may ask for
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # the largest temperature or penalty the float32 logits take


@dataclass
class SamplingParams:
    """Sampling settings, llama.cpp defaults. ``0`` switches top-k / min-p off, ``1`` switches top-p off."""

    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1 = off
    min_p: float = 0.05  # 0 = off
    repeat_penalty: float = 1.0  # 1 = off; positive logits / penalty, negative logits * penalty
    repeat_last_n: int = 64  # penalty window; 0 = no penalties, -1 = every token given to the penalties
    presence_penalty: float = 0.0  # subtracted once from every token seen in the window
    frequency_penalty: float = 0.0  # subtracted count times
    seed: int | None = None  # None = a random seed (recorded by Sampler.seed)
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # Added to the logits of these token ids before the penalties (OpenAI's logit_bias; -100 practically bans).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # None = off; k = each generated token's logprob and the k most probable alternatives (0..MAX_LOGPROBS).
    logprobs: int | None = None
    # None = off; k = the same for every prompt token but the first (the prompt is then prefilled in full).
    prompt_logprobs: int | None = None
    # False: prefill the whole prompt even where it repeats the previous request's (llama-server's cache_prompt)
    cache_prompt: bool = True

    def __post_init__(self) -> None:
        # Written as `not (x >= 0)` so that NaN is rejected as well.
        if not (0 <= self.temperature <= FLOAT32_MAX):
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy) within float32's range, "
                             f"got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.repeat_penalty <= FLOAT32_MAX):
            raise ValueError(
                f"repeat_penalty must be a number > 0 (1 = off) within float32's range, got {self.repeat_penalty}"
            )
        if int(self.repeat_last_n) != self.repeat_last_n or self.repeat_last_n < -1:
            raise ValueError(
                f"repeat_last_n must be an integer >= -1 (-1 = all, 0 = off), got {self.repeat_last_n}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not (abs(getattr(self, name)) <= FLOAT32_MAX):
                raise ValueError(f"{name} must be a number within float32's range, got {getattr(self, name)}")
        if int(self.max_tokens) != self.max_tokens or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens}")
        if self.seed is not None and int(self.seed) != self.seed:
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):  # OpenAI's API accepts a single string as well
            self.stop = [self.stop]
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a list of strings, got {self.stop!r}")
        self.stop = [s for s in self.stop if s]  # an empty stop string would end every generation at once
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or int(k) != k or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        for tok, bias in self.logit_bias.items():
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise ValueError(f"logit_bias[{tok}] must be a finite number, got {bias!r}")
        self.top_k = int(self.top_k)
        self.repeat_last_n = int(self.repeat_last_n)
        self.max_tokens = int(self.max_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )


# ------------------------------------------------------------------------------------------------------------
# Logit processing


def apply_penalties(
    logits: torch.Tensor, recent_tokens: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """Repeat / presence / frequency penalties, llama.cpp semantics; returns a new tensor.

    ``recent_tokens`` are the previous tokens, oldest first; only the last ``params.repeat_last_n`` count
    (all of them for -1). For every token with count ``c > 0`` in that window: a positive logit is divided by
    ``repeat_penalty``, a non-positive one multiplied; then ``c * frequency_penalty + presence_penalty`` is
    subtracted. ``logits`` is ``[V]`` or ``[N, V]`` (the same window applies to every row).
    """
    if not params.has_penalties:
        return logits.clone()
    tokens = torch.as_tensor(recent_tokens, dtype=torch.int64, device=logits.device).reshape(-1)
    if params.repeat_last_n > 0:
        tokens = tokens[-params.repeat_last_n :]
    vocab = logits.shape[-1]
    if tokens.numel() == 0:
        return logits.clone()
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
        raise ValueError(f"recent token ids must lie in [0, {vocab}), got {tokens.min()}..{tokens.max()}")
    counts = torch.bincount(tokens, minlength=vocab).to(logits.dtype)
    seen = counts > 0
    out = logits.clone()
    if params.repeat_penalty != 1.0:
        # A penalty below float32's smallest normal number acts as that number (in float32 it would be 0, and
        # -inf * 0 is NaN); a division that overflows is clamped below, so the logits never become NaN or +inf.
        p = max(params.repeat_penalty, torch.finfo(torch.float32).tiny)
        penalised = torch.where(out > 0, out / p, out * p)
        out = torch.where(seen, penalised, out)
    out = out - counts * params.frequency_penalty - seen.to(logits.dtype) * params.presence_penalty
    return out.clamp_(max=torch.finfo(out.dtype).max)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability, and the ``top`` most probable tokens as (id, logprob), most probable first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_of(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """``log_softmax`` (float32) of each row of ``logits`` (``[V]`` or ``[N, V]``): the logprob of ``tokens[i]``
    in row i, and the k largest of that row."""
    lp = torch.log_softmax(_as_rows(logits), dim=-1)
    ids = torch.tensor(tokens, dtype=torch.int64, device=lp.device).reshape(-1, 1)
    chosen = lp.gather(-1, ids).reshape(-1).tolist()
    if k <= 0:
        return [TokenLogprob(t, c) for t, c in zip(tokens, chosen)]
    vals, top = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    return [TokenLogprob(t, c, tuple(zip(i, v)))
            for t, c, i, v in zip(tokens, chosen, top.tolist(), vals.tolist())]


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    # torch.argmax returns the first maximal index: the lowest index wins ties.
    idx = torch.argmax(logits, dim=-1, keepdim=True)
    return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, idx, 1.0)


def _top_k_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the k largest logits per row, ascending; ties at the boundary go to the lower ids."""
    kth = torch.topk(x, k, dim=-1).values[:, -1:]
    above, tied = x > kth, x == kth
    room = k - above.sum(-1, keepdim=True)  # how many of the tied tokens make it, lowest ids first
    keep = above | (tied & (torch.cumsum(tied.to(torch.int32), dim=-1) <= room))
    return keep.nonzero()[:, 1].reshape(x.shape[0], k)


def _top_p_ids(x: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """Ids (ascending) of a set of top tokens per row holding the whole top-p nucleus and every token tied
    with its last member; None when the nucleus is too wide to be worth it (the caller then sorts all)."""
    vocab = x.shape[-1]
    log_z = torch.logsumexp(x.double(), dim=-1, keepdim=True)
    width = min(1024, vocab)
    while width <= vocab // 4:
        vals, ids = torch.topk(x, width, dim=-1)  # sorted; the order among ties does not change the count
        p = torch.exp(vals.double() - log_z)
        last = ((torch.cumsum(p, dim=-1) - p) < top_p).sum(-1, keepdim=True) - 1
        if bool((vals.gather(-1, last) > vals[:, -1:]).all()):
            return torch.sort(ids, dim=-1).values
        width *= 4
    return None


def _candidates(x: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of rows ``x[N, V]`` that can survive the filters: ``(logits[N, C], ids[N, C])``.

    Sorted by logit descending, ties by id, when top-p needs the order. Only C of the V tokens are looked at
    where possible: the top-k set, else the min-p set of the widest row, else a set holding the top-p nucleus
    (a full stable sort of 152K logits costs ~10x a ``topk`` on a CPU).
    """
    n, vocab = x.shape
    ids = None
    if 0 < params.top_k < vocab:
        ids = _top_k_ids(x, params.top_k)
    elif params.min_p > 0.0:
        width = int((x >= x.max(-1, keepdim=True).values + math.log(params.min_p)).sum(-1).max())
        if width <= vocab // 4:  # tokens below the min-p cut that land here do not matter: masked later
            ids = torch.sort(torch.topk(x, width, dim=-1).indices, dim=-1).values
    elif params.top_p < 1.0:
        ids = _top_p_ids(x, params.top_p)
    if ids is None:
        ids = torch.arange(vocab, device=x.device).expand(n, vocab)
    vals = x.gather(-1, ids)
    if params.top_p < 1.0:
        vals, order = torch.sort(vals, dim=-1, descending=True, stable=True)
        ids = ids.gather(-1, order)
    return vals, ids


def _filtered(x: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling probabilities (float32) over the candidate tokens of rows ``x[N, V]``: ``(probs, ids)``."""
    vals, ids = _candidates(x, params)
    keep = torch.ones_like(vals, dtype=torch.bool)
    if params.top_p < 1.0:
        # float64: the cut lands where thousands of small probabilities have been summed
        if (
            0 < params.top_k < x.shape[-1]
        ):  # top-p sees the distribution renormalized over the top-k survivors
            log_p = vals.double() - torch.logsumexp(vals.double(), dim=-1, keepdim=True)
        else:  # the candidates are a prefix of the sorted vocabulary: normalize over all of it
            log_p = vals.double() - torch.logsumexp(x.double(), dim=-1, keepdim=True)
        p = torch.exp(log_p)
        mass_before = torch.cumsum(p, dim=-1) - p  # mass of the strictly more probable tokens
        keep &= mass_before < params.top_p  # the first token is always kept (0 < top_p)
    if params.min_p > 0.0:  # p >= min_p * p_max, in log space
        keep &= vals >= vals.max(-1, keepdim=True).values + math.log(params.min_p)
    # Tempered softmax with the row's max subtracted before dividing: a tiny temperature sends every other
    # logit to -inf instead of overflowing to inf - inf = NaN, giving the argmax (ties share it); below float32's
    # smallest normal number the temperature acts as that number (in float32 it would be 0, and 0 / 0 is NaN).
    scaled = (vals - vals.max(-1, keepdim=True).values).masked_fill(~keep, -math.inf)
    probs = torch.softmax(scaled / max(params.temperature, torch.finfo(torch.float32).tiny), dim=-1)
    return probs, ids


def _as_rows(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() not in (1, 2):
        raise ValueError(f"logits must be [V] or [N, V], got shape {tuple(logits.shape)}")
    return logits.float().reshape(-1, logits.shape[-1])


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from: float32, normalized over the last dim, shaped as ``logits``.

    Order (llama.cpp): top-k, then top-p on the renormalized survivors (the smallest prefix of the sorted
    tokens whose mass reaches ``top_p``), then min-p (keep ``p >= min_p * p_max``), then temperature on the
    survivors. Greedy returns the one-hot of the argmax (lowest index on ties). Penalties are not applied here
    (see :func:`apply_penalties`). Ties in top-k are broken towards the lower token id.
    """
    x = _as_rows(logits)
    if params.greedy:
        return _one_hot_argmax(x).reshape(logits.shape)
    probs, ids = _filtered(x, params)
    return torch.zeros_like(x).scatter_(-1, ids, probs).reshape(logits.shape)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Draw one token from ``logits[V]`` (penalties already applied): argmax if greedy, else a random draw
    from :func:`probs_from_logits`'s distribution with ``generator``."""
    if logits.dim() != 1:
        raise ValueError(f"sample() takes logits of shape [V], got {tuple(logits.shape)}")
    if params.greedy:
        return argmax(logits)
    probs, ids = _filtered(_as_rows(logits), params)
    return int(ids[0, draw_rows(probs[0], generator)])


def argmax(logits: torch.Tensor) -> int:
    """The greedy token of ``logits[V]``: torch.argmax's answer (lowest index on ties, a NaN wins), through the
    C++ kernel for float32 rows on the CPU (torch.argmax costs ~30 us per 32K-value row here)."""
    if logits.dtype == torch.float32 and not logits.is_cuda:
        k = load_kernel()
        if k is not None:
            return k.argmax1(logits)
    return int(torch.argmax(logits))


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """`argmax` of every row of ``logits[R, V]``, in one call."""
    if logits.dtype == torch.float32 and not logits.is_cuda:
        k = load_kernel()
        if k is not None:
            return k.argmax_rows(logits.contiguous()).tolist()
    return torch.argmax(logits, dim=-1).tolist()


def draw_rows(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of non-negative (not necessarily normalized) ``probs[..., V]``; int64 ``[...]``.

    Inverse-CDF sampling in float64 on the generator's device: one uniform per row, far cheaper than
    ``torch.multinomial`` for a large vocabulary on CPU (about 0.2 ms vs 5 ms at V = 152K), and a token with
    zero probability is never returned. Raises ValueError for an all-zero or NaN row.
    """
    device = probs.device
    if generator is not None and device != generator.device:
        probs = probs.to(generator.device)
    cum = torch.cumsum(probs.double(), dim=-1)
    total = cum[..., -1:]
    if not bool((total > 0).all()):
        raise ValueError("cannot sample from an all-zero (or NaN) distribution")
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=torch.float64) * total
    # Keep u < total after rounding: the first index with cum > u then always has mass.
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, u, right=True).squeeze(-1).to(device)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(draw_rows(probs, generator))


class Sampler:
    """Per-sequence sampling state: the parameters, a seeded ``torch.Generator`` and the penalty window.

    ``seed`` holds the seed actually used (drawn at random when ``params.seed`` is None), for reports.
    Feed every token of the context that should count for penalties to :meth:`accept` (prompt tokens included,
    as llama.cpp does); :meth:`sample` accepts its own draw unless told otherwise.
    """

    def __init__(self, params: SamplingParams | None = None, device: torch.device | str | None = None) -> None:
        self.params = params if params is not None else SamplingParams()
        self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device=device or compute_device.current())
        self.generator.manual_seed(self.seed)
        n = self.params.repeat_last_n
        self._window: deque[int] = deque(maxlen=n if n > 0 else None)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.params.logit_bias:
            ids, vals = zip(*self.params.logit_bias.items())
            self._bias = (torch.tensor(ids, dtype=torch.int64, device=self.generator.device),
                          torch.tensor(vals, dtype=torch.float32, device=self.generator.device))
        self.logprobs: list[TokenLogprob] = []  # of the tokens chosen since the last take_logprobs()

    def reset(self) -> None:
        """Reseed and clear the window: the next draws repeat those of a fresh Sampler."""
        self.generator.manual_seed(self.seed)
        self._window.clear()

    def accept(self, tokens: int | Iterable[int]) -> None:
        if self.params.repeat_last_n == 0:
            return
        if isinstance(tokens, int):
            self._window.append(tokens)
            return
        n = self._window.maxlen  # only the last n can stay (a prompt of 64K tokens took ~11 ms to pass through)
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(-1)
            tokens = (tokens if n is None else tokens[-n:]).tolist()
        elif n is not None and isinstance(tokens, Sequence):
            tokens = tokens[-n:]
        self._window.extend(int(t) for t in tokens)

    @property
    def window(self) -> list[int]:
        """The penalty window's tokens, oldest first (set it to go back to an earlier state)."""
        return list(self._window)

    @window.setter
    def window(self, tokens: list[int]) -> None:
        self._window.clear()
        self._window.extend(tokens)

    @property
    def recent_tokens(self) -> torch.Tensor:
        return torch.tensor(list(self._window), dtype=torch.int64, device=self.generator.device)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits with the logit bias and then the penalties of the current window applied (llama.cpp's order)."""
        if self._bias is not None:
            ids, vals = self._bias
            logits = logits.clone()
            logits[..., ids] += vals.to(logits.dtype)
        if not self.params.has_penalties or not self._window:
            return logits
        return apply_penalties(logits, self.recent_tokens, self.params)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution :meth:`sample` would draw from (e.g. the ``p`` / ``q`` rows for verification)."""
        return probs_from_logits(self.process(logits), self.params)

    def chose(self, token: int, processed: torch.Tensor) -> None:
        """``token`` was drawn from ``processed`` (a ``[V]`` row of :meth:`process`'s output): record its logprobs
        when ``params.logprobs`` asks for them, and accept it into the penalty window."""
        if self.params.logprobs is not None:
            self.logprobs += logprobs_of(processed, [token], self.params.logprobs)
        self.accept(token)

    def take_logprobs(self) -> list[TokenLogprob]:
        """The logprobs recorded since the last call, one per chosen token, in order."""
        out, self.logprobs = self.logprobs, []
        return out

    @property
    def plain_greedy(self) -> bool:
        """Greedy over the raw logits (no bias, penalties or logprobs): the token is the row's `argmax`, which a
        caller may take for many rows at once and hand over with :meth:`took`."""
        p = self.params
        return p.greedy and self._bias is None and not p.has_penalties and p.logprobs is None

    def took(self, token: int) -> int:
        """A :attr:`plain_greedy` sampler's token chosen outside it (its logits row's argmax), recorded as
        :meth:`sample` records its own draw."""
        self.accept(token)
        return token

    def sample(self, logits: torch.Tensor, accept: bool = True) -> int:
        processed = self.process(logits)
        token = sample(processed, self.params, self.generator)
        if accept:
            self.chose(token, processed)
        return token
