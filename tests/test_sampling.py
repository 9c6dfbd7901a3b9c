"""Tests for turbospec.sampling: filters on hand-computed examples, penalties, seeds, greedy, and a
statistical check that the engine's speculative verifier (turbospec.speculative.verify.verify, drawing
through a Sampler) preserves the target distribution (with negative controls)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from turbospec.sampling import (
    Sampler,
    SamplingParams,
    apply_penalties,
    probs_from_logits,
    sample,
)
from turbospec.speculative.tree import DraftTree
from turbospec.speculative.verify import verify

OFF = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}  # every filter switched off


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small tensors only: intra-op threads just add contention on a shared CPU (3-10x slower under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def logits_of(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a, torch.tensor(b, dtype=torch.float32), atol=tol, rtol=0)


# ------------------------------------------------------------------------------------------------------------
# SamplingParams


def test_defaults_are_llama_cpp():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty) == (1.0, 64, 0.0, 0.0)
    assert (p.seed, p.max_tokens, p.stop, p.ignore_eos) == (None, 128, [], False)
    assert not p.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams().stop is not SamplingParams().stop  # no shared mutable default


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"min_p": -0.01},
        {"min_p": 1.01},
        {"top_k": -1},
        {"top_k": 2.5},
        {"repeat_penalty": 0.0},
        {"repeat_penalty": -1.0},
        {"repeat_last_n": -2},
        {"max_tokens": -1},
        {"presence_penalty": float("inf")},
        {"stop": [1]},
    ],
)
def test_invalid_params_raise_one_line(kwargs):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    msg = str(exc.value)
    assert msg and "\n" not in msg
    assert next(iter(kwargs)) in msg


def test_stop_string_is_wrapped():
    assert SamplingParams(stop="</s>").stop == ["</s>"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=["", "x"]).stop == ["x"]


# ------------------------------------------------------------------------------------------------------------
# Penalties


def test_penalties_hand_computed():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    recent = torch.tensor([0, 1, 0, 3, 4])  # counts: 0 -> 2, 1 -> 1, 3 -> 1, 4 -> 1
    params = SamplingParams(repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, recent, params)
    # token 0:  2.0 / 2 - 2 * 0.25 - 0.5 = 0.0
    # token 1: -1.0 * 2 - 1 * 0.25 - 0.5 = -2.75
    # token 2: not in the window, unchanged
    # token 3:  3.0 / 2 - 0.25 - 0.5 = 0.75
    # token 4:  0.0 stays 0.0 under the repeat penalty, then - 0.75
    close(out, [0.0, -2.75, 0.5, 0.75, -0.75])
    close(logits, [2.0, -1.0, 0.5, 3.0, 0.0])  # input untouched


def test_repeat_penalty_only_divides_positive_multiplies_negative():
    out = apply_penalties(
        torch.tensor([4.0, -4.0, 1.0]), torch.tensor([0, 1, 0, 0]), SamplingParams(repeat_penalty=1.6)
    )
    close(out, [2.5, -6.4, 1.0])  # applied once per token, whatever its count


def test_penalty_window():
    logits = torch.zeros(4)
    recent = torch.tensor([0, 1, 2, 2])
    p = {"frequency_penalty": 1.0}
    close(apply_penalties(logits, recent, SamplingParams(repeat_last_n=2, **p)), [0, 0, -2, 0])
    close(apply_penalties(logits, recent, SamplingParams(repeat_last_n=3, **p)), [0, -1, -2, 0])
    close(apply_penalties(logits, recent, SamplingParams(repeat_last_n=-1, **p)), [-1, -1, -2, 0])
    close(apply_penalties(logits, recent, SamplingParams(repeat_last_n=0, **p)), [0, 0, 0, 0])
    close(apply_penalties(logits, torch.tensor([], dtype=torch.int64), SamplingParams(**p)), [0, 0, 0, 0])


def test_penalties_batched_and_validated():
    logits = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    out = apply_penalties(logits, torch.tensor([1]), SamplingParams(presence_penalty=1.0))
    close(out, [[1.0, 1.0], [3.0, -2.0]])
    with pytest.raises(ValueError):
        apply_penalties(torch.zeros(3), torch.tensor([3]), SamplingParams(presence_penalty=1.0))


# ------------------------------------------------------------------------------------------------------------
# Filters (llama.cpp order: top-k, top-p, min-p, then temperature)


def test_top_k():
    probs = probs_from_logits(logits_of([0.1, 0.4, 0.2, 0.3]), SamplingParams(**{**OFF, "top_k": 2}))
    close(probs, [0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7])
    assert probs.dtype == torch.float32


def test_top_k_ties_keep_lowest_ids():
    close(probs_from_logits(torch.zeros(4), SamplingParams(**{**OFF, "top_k": 2})), [0.5, 0.5, 0.0, 0.0])


def test_top_k_larger_than_vocab_is_off():
    close(probs_from_logits(logits_of([0.6, 0.4]), SamplingParams(**{**OFF, "top_k": 40})), [0.6, 0.4])


def test_top_p_keeps_smallest_prefix_reaching_p():
    base = [0.5, 0.25, 0.15, 0.1]
    # cumulative 0.5, 0.75: 0.75 >= 0.7 -> keep two
    close(probs_from_logits(logits_of(base), SamplingParams(**{**OFF, "top_p": 0.7})), [2 / 3, 1 / 3, 0, 0])
    # cumulative 0.5, 0.75, 0.9 -> keep three
    close(
        probs_from_logits(logits_of(base), SamplingParams(**{**OFF, "top_p": 0.8})),
        [5 / 9, 2.5 / 9, 1.5 / 9, 0],
    )
    # top_p smaller than the top token's mass keeps the top token
    close(probs_from_logits(logits_of(base), SamplingParams(**{**OFF, "top_p": 0.1})), [1, 0, 0, 0])


def test_top_p_sees_the_top_k_renormalized_distribution():
    # After top-k=3: [0.5, 0.25, 0.15] / 0.9 = [0.556, 0.278, 0.167]; cumulative 0.556, 0.833 >= 0.8 -> two.
    # (On the original probabilities the cumulative would be 0.5, 0.75 < 0.8 and three would survive.)
    params = SamplingParams(**{**OFF, "top_k": 3, "top_p": 0.8})
    close(probs_from_logits(logits_of([0.5, 0.25, 0.15, 0.1]), params), [2 / 3, 1 / 3, 0, 0])


def test_min_p():
    base = [0.5, 0.25, 0.15, 0.1]
    # threshold 0.4 * 0.5 = 0.2 -> keep 0.5 and 0.25
    close(probs_from_logits(logits_of(base), SamplingParams(**{**OFF, "min_p": 0.4})), [2 / 3, 1 / 3, 0, 0])
    # threshold 0.25 * 0.5 = 0.125 -> keep three
    close(
        probs_from_logits(logits_of(base), SamplingParams(**{**OFF, "min_p": 0.25})),
        [5 / 9, 2.5 / 9, 1.5 / 9, 0],
    )
    close(probs_from_logits(logits_of(base), SamplingParams(**{**OFF, "min_p": 1.0})), [1, 0, 0, 0])


def test_temperature():
    # p ** (1 / T) renormalized: T = 0.5 squares, T = 2 takes the square root
    close(
        probs_from_logits(logits_of([0.5, 0.25, 0.25]), SamplingParams(**{**OFF, "temperature": 0.5})),
        [2 / 3, 1 / 6, 1 / 6],
    )
    s = [math.sqrt(0.64), math.sqrt(0.36)]
    close(
        probs_from_logits(logits_of([0.64, 0.36]), SamplingParams(**{**OFF, "temperature": 2.0})),
        [s[0] / sum(s), s[1] / sum(s)],
    )


def test_temperature_is_applied_after_the_filters():
    # min-p on the untempered distribution: threshold 0.4 * 0.5 = 0.2 keeps all three, then T = 0.5 squares.
    # Tempering first would give [2/3, 1/6, 1/6], threshold 0.267, and leave only token 0.
    params = SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.4)
    close(probs_from_logits(logits_of([0.5, 0.25, 0.25]), params), [2 / 3, 1 / 6, 1 / 6])


def test_all_filters_together():
    # top-k 4 -> [.4, .2, .15, .1] / .85; top-p .9: cumulative .47, .71, .88, 1.0 -> four stay;
    # min-p .3: threshold .3 * .4 = .12 -> .1 goes; T = 1 -> [.4, .2, .15] / .75
    probs = [0.05, 0.4, 0.1, 0.2, 0.15, 0.06, 0.04]
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.9, min_p=0.3)
    close(probs_from_logits(logits_of(probs), params), [0, 0.4 / 0.75, 0, 0.2 / 0.75, 0.15 / 0.75, 0, 0])


def test_defaults_give_a_normalized_float32_distribution():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    probs = probs_from_logits(logits, SamplingParams())
    assert probs.dtype == torch.float32 and probs.shape == (3, 1000)
    close(probs.sum(-1), [1.0, 1.0, 1.0], tol=1e-5)
    assert int((probs > 0).sum(-1).max()) <= 40
    for row in range(3):  # batched == row by row
        torch.testing.assert_close(probs[row], probs_from_logits(logits[row], SamplingParams()))


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The filters the plain way: one stable full sort per row, then each filter in llama.cpp order."""
    rows = []
    for x in logits.double().reshape(-1, logits.shape[-1]):
        vals, ids = torch.sort(x, descending=True, stable=True)
        keep = torch.ones_like(vals, dtype=torch.bool)
        if 0 < params.top_k < len(x):
            keep[params.top_k :] = False
        if params.top_p < 1:
            p = torch.softmax(vals.masked_fill(~keep, -math.inf), -1)
            keep &= torch.cumsum(p, -1) - p < params.top_p
        if params.min_p > 0:
            p = torch.softmax(vals, -1)
            keep &= p >= params.min_p * p[0]
        probs = torch.softmax(vals.masked_fill(~keep, -math.inf) / params.temperature, -1)
        rows.append(torch.zeros_like(x).scatter_(0, ids, probs).float())
    return torch.stack(rows).reshape(logits.shape)


@pytest.mark.parametrize("seed", range(12))
def test_fast_candidate_paths_match_a_full_sort(seed):
    # Large enough vocabularies for every path: top-k via topk with tie repair, the min-p set, the top-p
    # nucleus search and the full-sort fallback. Rounded logits make ties at every boundary.
    g = torch.Generator().manual_seed(seed)
    vocab = [50, 5000, 20000][seed % 3]
    scale = [0.5, 2.0, 6.0][seed // 3 % 3]
    logits = torch.randn(3, vocab, generator=g) * scale
    if seed % 2:
        logits = logits.round()
    configs = [
        {"top_k": 40, "top_p": 0.95, "min_p": 0.05},
        {"top_k": 7, "top_p": 1.0, "min_p": 0.0},
        {"top_k": 0, "top_p": 0.9, "min_p": 0.0},
        {"top_k": 0, "top_p": 0.5, "min_p": 0.02},
        {"top_k": 0, "top_p": 1.0, "min_p": 0.1},
        {"top_k": 0, "top_p": 1.0, "min_p": 0.0},
    ]
    for cfg in configs:
        params = SamplingParams(temperature=0.7, **cfg)
        got = probs_from_logits(logits, params)
        torch.testing.assert_close(got, reference_probs(logits, params), atol=1e-6, rtol=1e-5, msg=str(cfg))
        assert ((got > 0) == (reference_probs(logits, params) > 0)).all(), cfg


def test_greedy_one_hot_and_lowest_index_tie_break():
    logits = torch.tensor([1.0, 3.0, 3.0, 0.0])
    greedy = SamplingParams(temperature=0.0)
    close(probs_from_logits(logits, greedy), [0, 1, 0, 0])
    close(probs_from_logits(torch.stack([logits, logits.flip(0)]), greedy), [[0, 1, 0, 0], [0, 1, 0, 0]])
    assert sample(logits, greedy) == 1
    assert sample(torch.full((5,), 2.0), greedy) == 0


def test_minus_inf_logits_never_sampled():
    logits = torch.tensor([0.0, -math.inf, 1.0, -math.inf])
    probs = probs_from_logits(logits, SamplingParams(**OFF))
    assert probs[1] == 0 and probs[3] == 0
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, SamplingParams(**OFF), g) for _ in range(200)} == {0, 2}


# ------------------------------------------------------------------------------------------------------------
# Seeds and the Sampler


def test_seed_reproducibility():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(seed=1234, temperature=1.0)
    a, b = Sampler(params), Sampler(params)
    seq_a = [a.sample(logits) for _ in range(64)]
    assert seq_a == [b.sample(logits) for _ in range(64)]
    assert len(set(seq_a)) > 1
    c = Sampler(SamplingParams(seed=4321, temperature=1.0))
    assert seq_a != [c.sample(logits) for _ in range(64)]
    a.reset()
    assert seq_a == [a.sample(logits) for _ in range(64)]
    # with the pure function and a generator seeded the same way
    g = torch.Generator().manual_seed(1234)
    assert seq_a == [sample(logits, params, g) for _ in range(64)]


def test_random_seed_is_recorded():
    a, b = Sampler(SamplingParams()), Sampler(SamplingParams())
    assert isinstance(a.seed, int) and a.seed != b.seed
    logits = torch.randn(20)
    seq = [a.sample(logits) for _ in range(20)]
    g = torch.Generator().manual_seed(a.seed)
    assert seq == [sample(logits, a.params, g) for _ in range(20)]


def test_sampler_applies_penalties_over_its_window():
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.1, repeat_last_n=2))
    logits = torch.tensor([2.0, 1.9, 1.85])
    # 0; then 0 is penalised (2 / 1.1 = 1.82 < 1.9) -> 1; then 0 and 1 are (1.82, 1.73 < 1.85) -> 2;
    # then 0 has left the window -> 0
    assert [s.sample(logits) for _ in range(4)] == [0, 1, 2, 0]
    s.reset()
    s.accept(torch.tensor([0, 1]))  # e.g. the prompt
    assert s.sample(logits) == 2
    assert s.recent_tokens.tolist() == [1, 2]


def test_sample_frequencies_match_probs():
    logits = torch.randn(6, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(**OFF)
    g = torch.Generator().manual_seed(11)
    counts = np.bincount([sample(logits, params, g) for _ in range(4000)], minlength=6)
    assert chi2_pvalue(counts, probs_from_logits(logits, params).numpy()) > 1e-3


# ------------------------------------------------------------------------------------------------------------
# Speculative verification: the engine's verifier, turbospec.speculative.verify.verify, on chain draft trees.
# logits[i] is the target's row for the position of draft i; logits[k] predicts the token after the draft.

GREEDY = SamplingParams(temperature=0)
SAMPLE = SamplingParams(**OFF)  # temperature 1, every filter off: the sampler's p is softmax(logits)


def run_verify(draft, logits, params=GREEDY, q=None, generator=None) -> tuple[int, int]:
    """verify() on ``DraftTree.chain(draft, q)``: (number of drafts accepted, next token)."""
    sampler = Sampler(params)
    if generator is not None:
        sampler.generator = generator
    path, token = verify(DraftTree.chain(list(draft), q), logits, sampler)
    assert path == list(range(len(path)))  # a chain accepts a prefix of its nodes
    return len(path), token


def test_verify_greedy_hand_computed():
    target = torch.zeros(4, 6)
    for row, best in enumerate([3, 1, 4, 2]):
        target[row, best] = 1.0
    assert run_verify([3, 1, 5], target) == (2, 4)
    assert run_verify([3, 1, 4], target) == (3, 2)
    assert run_verify([0, 1, 4], target) == (0, 3)
    assert run_verify([], target[:1]) == (0, 3)


def test_verify_greedy_ties_use_lowest_index():
    target = torch.tensor([[0.0, 5.0, 5.0], [1.0, 0.0, 0.0]])
    assert run_verify([1], target) == (1, 0)
    assert run_verify([2], target) == (0, 1)


def test_verify_greedy_ignores_draft_distributions():
    target = torch.tensor([[0.0, 5.0, 1.0], [1.0, 0.0, 0.0]])
    q = [torch.tensor([0.0, 0.0, 1.0])]  # a q that would make sampling reject token 1 never matters here
    assert run_verify([1], target, q=q) == (1, 0)
    assert run_verify([2], target, q=q) == (0, 1)


# ------------------------------------------------------------------------------------------------------------
# Rejection sampling: deterministic properties


def test_rejection_accepts_everything_when_q_equals_p():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 8, generator=g)
    p = [probs_from_logits(row, SAMPLE) for row in logits]  # exactly the sampler's p: p(x) / q(x) == 1
    for _ in range(200):
        n, tok = run_verify([1, 5, 2], logits, SAMPLE, q=p[:3], generator=g)
        assert n == 3 and p[3][tok] > 0


def test_rejection_never_accepts_or_returns_a_zero_probability_token():
    g = torch.Generator().manual_seed(0)
    logits = logits_of([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = [torch.tensor([0.7, 0.1, 0.1, 0.1])]
    for _ in range(200):
        n, tok = run_verify([0], logits, SAMPLE, q=q, generator=g)
        assert n == 0 and tok in (1, 2)
        n, tok = run_verify([0], logits, SAMPLE, generator=g)  # one-hot q
        assert n == 0 and tok in (1, 2)


def test_rejection_one_hot_certain_target_always_accepts():
    g = torch.Generator().manual_seed(0)
    logits = logits_of([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    assert all(run_verify([1], logits, SAMPLE, generator=g)[0] == 1 for _ in range(100))


def test_verify_handles_mixed_outcomes_and_one_hot_targets_agree_with_greedy():
    target = torch.zeros(3, 5)
    target[0, 2] = target[1, 3] = target[2, 4] = 1.0  # argmax 2, 3, 4
    logits = torch.log(target)  # as sampling logits: one-hot targets, so rejection sampling is deterministic
    uniform = [torch.full((5,), 0.2)] * 2
    g = torch.Generator().manual_seed(0)
    for draft, expected in [([2, 3], (2, 4)), ([2, 0], (1, 3)), ([1, 3], (0, 2))]:
        assert run_verify(draft, target) == expected  # greedy
        for _ in range(20):
            assert run_verify(draft, logits, SAMPLE, generator=g) == expected  # one-hot q
            assert run_verify(draft, logits, SAMPLE, q=uniform, generator=g) == expected  # probabilistic q


# ------------------------------------------------------------------------------------------------------------
# Rejection sampling preserves the target distribution: chi-square tests with fixed seeds.
#
# Toy target and draft "models" over V = 8 tokens are first-order Markov chains, p(x | prev) = P[prev] and
# q(x | prev) = Q[prev], so that later positions are conditioned on earlier tokens as in real decoding.
# Sequences start after token START; speculative decoding with chain length k runs until m tokens are emitted.
# The first token must follow P[START] and the first two the joint P[START, a] * P[a, b]. The harness drafts
# for all sequences at once and hands the chains to a batch verifier; for the engine's verify() that is
# EngineVerifier, which verifies them one by one.


def chi2_pvalue(observed, expected_probs) -> float:
    """Pearson chi-square goodness of fit; cells expected below 5 are pooled. p = Q(df/2, stat/2)."""
    observed = np.asarray(observed, dtype=np.float64).ravel()
    expected = np.asarray(expected_probs, dtype=np.float64).ravel()
    expected = expected / expected.sum() * observed.sum()
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    q = torch.special.gammaincc(
        torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
    )
    return float(q)


def test_chi2_pvalue_matches_known_values():
    # Deviations d from an expected 10 (resp. 50) per cell chosen so that the statistic is 12 with df = 7
    # (scipy.stats.chi2.sf(12, 7) = 0.100559) and 3.841459 with df = 1 (the 5% critical value).
    d = 60**0.5
    assert chi2_pvalue([10 + d, 10 - d] + [10] * 6, [1] * 8) == pytest.approx(0.100559, abs=1e-6)
    d = (3.841459 * 25) ** 0.5
    assert chi2_pvalue([50 + d, 50 - d], [1, 1]) == pytest.approx(0.05, abs=1e-6)
    # expected [2, 2, 996] pools to [4, 996]: statistic 16/4 + 16/996 = 4.016, df = 1 -> p = 0.045
    assert chi2_pvalue([0, 0, 1000], [0.002, 0.002, 0.996]) == pytest.approx(0.0451, abs=1e-3)


V = 8
START = 0
N_BATCH = 50_000
N_CONTROL = 10_000  # the negative controls are caught with a fifth of the samples
PASS = 1e-3  # a correct sampler fails this with probability 0.1% per seed; the seeds here are fixed
FAIL = 1e-6


class ToyModels:
    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.P = torch.softmax(torch.randn(V, V, generator=g), -1)
        self.Q = torch.softmax(torch.randn(V, V, generator=g), -1)
        self.draft_gen = torch.Generator().manual_seed(seed + 1)
        self.verify_gen = torch.Generator().manual_seed(seed + 2)

    def draft(self, prev: torch.Tensor, one_hot: bool) -> torch.Tensor:
        if one_hot:  # a deterministic drafter: the argmax of its own distribution
            return self.Q[prev].argmax(-1)
        return torch.multinomial(self.Q[prev], 1, generator=self.draft_gen).squeeze(1)

    def first_token_probs(self) -> np.ndarray:
        return self.P[START].double().numpy()

    def first_two_joint(self) -> np.ndarray:
        P = self.P.double().numpy()
        return P[START][:, None] * P  # [a, b] = P(a | START) P(b | a)


def generate_batch(models: ToyModels, verify_batch, k: int, m: int, n: int, one_hot: bool) -> np.ndarray:
    """n sequences of speculative decoding with chain length k; returns the first m emitted tokens, [n, m].

    ``verify_batch(draft[B, k], q[B, k, V] or None, target_probs[B, k+1, V], generator)`` returns
    ``(num_accepted[B], next_token[B])``."""
    out = torch.full((n, m), -1, dtype=torch.int64)
    count = torch.zeros(n, dtype=torch.int64)
    last = torch.full((n,), START, dtype=torch.int64)
    active = torch.arange(n)
    while active.numel():
        ctx, drafts = last[active], []
        for _ in range(k):
            ctx = models.draft(ctx, one_hot)
            drafts.append(ctx)
        draft = torch.stack(drafts, 1)
        parents = torch.cat([last[active, None], draft], 1)  # the context token of each verified position
        q = None if one_hot else models.Q[parents[:, :-1]]
        n_acc, token = verify_batch(draft, q, models.P[parents], models.verify_gen)
        emitted = torch.cat([draft, token[:, None]], 1)
        emitted[torch.arange(len(active)), n_acc] = token  # draft[:n_acc] + [token]
        for j in range(k + 1):
            ok = (j <= n_acc) & (count[active] < m)
            rows = active[ok]
            out[rows, count[rows]] = emitted[ok, j]
            count[rows] += 1
        last[active] = token
        active = active[count[active] < m]
    return out.numpy()


class EngineVerifier:
    """generate_batch's batch-verifier interface on top of the engine's verify(), one chain at a time:
    ``DraftTree.chain(draft, q rows or None)``, logits = log(target probs), and a Sampler with every filter
    off whose generator is the harness's. Records how many drafts each chain had accepted, so that the tests
    can check that rejections (and full acceptances) actually happened."""

    def __init__(self) -> None:
        # No penalties (the window is off too): one sampler can serve the chains of every sequence.
        self.sampler = Sampler(SamplingParams(**OFF, repeat_last_n=0, seed=0))
        self.accepted: list[int] = []

    def __call__(self, draft_tokens, draft_probs, target_probs, generator):
        self.sampler.generator = generator
        logits = torch.log(target_probs)
        n_acc, tokens = [], []
        for i, draft in enumerate(draft_tokens.tolist()):
            q = None if draft_probs is None else list(draft_probs[i])
            path, token = verify(DraftTree.chain(draft, q), logits[i], self.sampler)
            n_acc.append(len(path))
            tokens.append(token)
        self.accepted += n_acc
        return torch.tensor(n_acc, dtype=torch.int64), torch.tensor(tokens, dtype=torch.int64)

    def assert_mixed_outcomes(self, k: int) -> None:
        """Every outcome 0..k occurred: the runs rejected at every position and also accepted whole chains."""
        counts = np.bincount(self.accepted, minlength=k + 1)
        assert len(counts) == k + 1 and (counts > 0).all(), counts
        assert counts[:k].sum() > 0.1 * counts.sum(), counts  # rejections are common, not a rare event


def first_token_pvalue(models, out) -> float:
    return chi2_pvalue(np.bincount(out[:, 0], minlength=V), models.first_token_probs())


def joint_pvalue(models, out) -> float:
    return chi2_pvalue(np.bincount(out[:, 0] * V + out[:, 1], minlength=V * V), models.first_two_joint())


def test_toy_models_differ_enough_to_reject_often():
    models = ToyModels(101)
    tv = 0.5 * (models.P[START] - models.Q[START]).abs().sum()
    assert tv > 0.2  # P(rejection at the first position) = total variation distance


def test_rejection_k1_first_token_is_target():
    models, verifier = ToyModels(101), EngineVerifier()
    out = generate_batch(models, verifier, k=1, m=1, n=N_BATCH, one_hot=False)
    verifier.assert_mixed_outcomes(k=1)
    assert first_token_pvalue(models, out) > PASS


def test_rejection_k3_first_token_and_first_two_joint_are_target():
    models, verifier = ToyModels(202), EngineVerifier()
    out = generate_batch(models, verifier, k=3, m=2, n=N_BATCH, one_hot=False)
    verifier.assert_mixed_outcomes(k=3)
    assert first_token_pvalue(models, out) > PASS
    assert joint_pvalue(models, out) > PASS


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_one_hot_drafts_are_target(k):
    models, verifier = ToyModels(303), EngineVerifier()
    out = generate_batch(models, verifier, k=k, m=2, n=N_BATCH, one_hot=True)
    verifier.assert_mixed_outcomes(k=k)
    assert first_token_pvalue(models, out) > PASS
    assert joint_pvalue(models, out) > PASS


# Negative controls: the same harness and statistics detect wrong samplers, so the tests above can fail.
# They are batch implementations of their own, independent of the verifier under test.


def always_accept_batch(draft_tokens, draft_probs, target_probs, generator):
    batch, k = draft_tokens.shape
    token = torch.multinomial(target_probs[:, k], 1, generator=generator).squeeze(1)
    return torch.full((batch,), k), token


def resample_from_p_batch(draft_tokens, draft_probs, target_probs, generator):
    """A classic bug: the right acceptance test, but the replacement drawn from p instead of max(p - q, 0)."""
    batch, k = draft_tokens.shape
    p_x = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(-1)
    q_x = (
        torch.ones_like(p_x)
        if draft_probs is None
        else draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1)
    )
    accepted = torch.rand(batch, k, generator=generator) * q_x < p_x
    n = accepted.to(torch.int64).cumprod(-1).sum(-1)
    token = torch.multinomial(target_probs[torch.arange(batch), n], 1, generator=generator).squeeze(1)
    return n, token


def test_negative_control_always_accept_is_detected():
    models = ToyModels(101)
    out = generate_batch(models, always_accept_batch, k=1, m=1, n=N_CONTROL, one_hot=False)
    assert first_token_pvalue(models, out) < FAIL
    models = ToyModels(202)
    out = generate_batch(models, always_accept_batch, k=3, m=2, n=N_CONTROL, one_hot=False)
    assert joint_pvalue(models, out) < FAIL


def test_negative_control_wrong_residual_is_detected():
    models = ToyModels(101)
    out = generate_batch(models, resample_from_p_batch, k=1, m=1, n=N_CONTROL, one_hot=False)
    assert first_token_pvalue(models, out) < FAIL
    models = ToyModels(303)
    out = generate_batch(models, resample_from_p_batch, k=3, m=2, n=N_CONTROL, one_hot=True)
    assert joint_pvalue(models, out) < FAIL
