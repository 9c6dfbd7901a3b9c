"""Tests for turbospec.sampling: filters on hand-computed examples, penalties, seeds, greedy, and a statistical
check that speculative rejection sampling preserves the target distribution (with negative controls)."""

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
    verify_greedy,
    verify_rejection,
)

OFF = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)  # every filter switched off


def logits_of(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def close(a, b, tol=1e-6):
    torch.testing.assert_close(a, torch.tensor(b, dtype=torch.float32), atol=tol, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
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
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(min_p=-0.01),
        dict(min_p=1.01),
        dict(top_k=-1),
        dict(top_k=2.5),
        dict(repeat_penalty=0.0),
        dict(repeat_penalty=-1.0),
        dict(repeat_last_n=-2),
        dict(max_tokens=-1),
        dict(presence_penalty=float("inf")),
        dict(stop=[""]),
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


# ---------------------------------------------------------------------------------------------------------------
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
    out = apply_penalties(torch.tensor([4.0, -4.0, 1.0]), torch.tensor([0, 1, 0, 0]), SamplingParams(repeat_penalty=1.6))
    close(out, [2.5, -6.4, 1.0])  # applied once per token, whatever its count


def test_penalty_window():
    logits = torch.zeros(4)
    recent = torch.tensor([0, 1, 2, 2])
    p = dict(frequency_penalty=1.0)
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


# ---------------------------------------------------------------------------------------------------------------
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
    close(probs_from_logits(logits_of(base), SamplingParams(**{**OFF, "top_p": 0.8})), [5 / 9, 2.5 / 9, 1.5 / 9, 0])
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
    close(probs_from_logits(logits_of(base), SamplingParams(**{**OFF, "min_p": 0.25})), [5 / 9, 2.5 / 9, 1.5 / 9, 0])
    close(probs_from_logits(logits_of(base), SamplingParams(**{**OFF, "min_p": 1.0})), [1, 0, 0, 0])


def test_temperature():
    # p ** (1 / T) renormalized: T = 0.5 squares, T = 2 takes the square root
    close(probs_from_logits(logits_of([0.5, 0.25, 0.25]), SamplingParams(**{**OFF, "temperature": 0.5})),
          [2 / 3, 1 / 6, 1 / 6])
    s = [math.sqrt(0.64), math.sqrt(0.36)]
    close(probs_from_logits(logits_of([0.64, 0.36]), SamplingParams(**{**OFF, "temperature": 2.0})),
          [s[0] / sum(s), s[1] / sum(s)])


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


# ---------------------------------------------------------------------------------------------------------------
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
    n = 20_000
    counts = np.bincount([sample(logits, params, g) for _ in range(n)], minlength=6)
    assert chi2_pvalue(counts, probs_from_logits(logits, params).numpy()) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# Greedy verification


def test_verify_greedy_hand_computed():
    target = torch.zeros(4, 6)
    for row, best in enumerate([3, 1, 4, 2]):
        target[row, best] = 1.0
    assert verify_greedy(torch.tensor([3, 1, 5]), target) == (2, 4)
    assert verify_greedy(torch.tensor([3, 1, 4]), target) == (3, 2)
    assert verify_greedy(torch.tensor([0, 1, 4]), target) == (0, 3)
    assert verify_greedy(torch.tensor([], dtype=torch.int64), target[:1]) == (0, 3)


def test_verify_greedy_ties_use_lowest_index():
    target = torch.tensor([[0.0, 5.0, 5.0], [1.0, 0.0, 0.0]])
    assert verify_greedy(torch.tensor([1]), target) == (1, 0)
    assert verify_greedy(torch.tensor([2]), target) == (0, 1)


def test_verify_shape_errors():
    with pytest.raises(ValueError):
        verify_greedy(torch.tensor([1, 2]), torch.zeros(2, 4))
    with pytest.raises(ValueError):
        verify_rejection(torch.tensor([1]), torch.ones(2, 4) / 4, torch.ones(2, 4) / 4)
    with pytest.raises(ValueError):
        verify_rejection(torch.tensor([7]), None, torch.ones(2, 4) / 4)


# ---------------------------------------------------------------------------------------------------------------
# Rejection sampling: deterministic properties


def test_rejection_accepts_everything_when_q_equals_p():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 8, generator=g), -1)
    for _ in range(200):
        n, tok = verify_rejection(torch.tensor([1, 5, 2]), p[:3], p, g)
        assert n == 3 and p[3, tok] > 0


def test_rejection_never_accepts_or_returns_a_zero_probability_token():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.7, 0.1, 0.1, 0.1]])
    for _ in range(200):
        n, tok = verify_rejection(torch.tensor([0]), q, p, g)
        assert n == 0 and tok in (1, 2)
        n, tok = verify_rejection(torch.tensor([0]), None, p, g)  # one-hot q
        assert n == 0 and tok in (1, 2)


def test_rejection_one_hot_certain_target_always_accepts():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    assert all(verify_rejection(torch.tensor([1]), None, p, g)[0] == 1 for _ in range(100))


# ---------------------------------------------------------------------------------------------------------------
# Rejection sampling preserves the target distribution: chi-square tests with fixed seeds


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
    q = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    return float(q)


V = 8
START = 0


class ToyModels:
    """A target and a draft "model" over V tokens: first-order Markov chains p(x | prev) = P[prev]."""

    def __init__(self, seed: int, draft_temperature: float = 1.0):
        g = torch.Generator().manual_seed(seed)
        self.P = torch.softmax(torch.randn(V, V, generator=g), -1)
        self.Q = torch.softmax(torch.randn(V, V, generator=g) * draft_temperature, -1)
        self.cumQ = np.cumsum(self.Q.double().numpy(), axis=1)
        self.P64 = self.P.double().numpy()

    def draft(self, prev: int, rng: np.random.Generator, one_hot: bool) -> int:
        if one_hot:  # a deterministic drafter: argmax of its own distribution
            return int(torch.argmax(self.Q[prev]))
        return min(int(np.searchsorted(self.cumQ[prev], rng.random(), side="right")), V - 1)

    def first_token_probs(self) -> np.ndarray:
        return self.P64[START]

    def first_two_joint(self) -> np.ndarray:
        return self.P64[START][:, None] * self.P64  # [a, b] = P(a | start) P(b | a)


def generate(models: ToyModels, verify, k: int, m: int, rng, gen, one_hot: bool = False) -> list[int]:
    """Speculative decoding with chain length k until m tokens are emitted; returns the first m."""
    seq = [START]
    while len(seq) <= m:
        drafts, ctx = [], seq[-1]
        for _ in range(k):
            ctx = models.draft(ctx, rng, one_hot)
            drafts.append(ctx)
        parents = [seq[-1], *drafts]
        q = None if one_hot else models.Q[parents[:-1]]
        n, tok = verify(torch.tensor(drafts), q, models.P[parents], gen)
        seq += drafts[:n] + [tok]
    return seq[1 : m + 1]


def run_experiment(verify, k: int, n_samples: int, seed: int, one_hot: bool = False, m: int = 1):
    models = ToyModels(seed)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    out = np.array([generate(models, verify, k, m, rng, gen, one_hot) for _ in range(n_samples)])
    return models, out


def first_token_pvalue(models, out) -> float:
    return chi2_pvalue(np.bincount(out[:, 0], minlength=V), models.first_token_probs())


def joint_pvalue(models, out) -> float:
    return chi2_pvalue(np.bincount(out[:, 0] * V + out[:, 1], minlength=V * V), models.first_two_joint())


N = 10_000
PASS = 1e-3  # a correct sampler fails this with probability 0.1% per seed; the seeds here are fixed
FAIL = 1e-6


def test_rejection_k1_marginal_is_target():
    models, out = run_experiment(verify_rejection, k=1, n_samples=N, seed=101)
    tv = 0.5 * np.abs(models.P64[START] - models.Q.double().numpy()[START]).sum()
    assert tv > 0.2  # p and q differ substantially: many rejections happen
    assert first_token_pvalue(models, out) > PASS


def test_rejection_k3_first_token_and_first_two_joint_are_target():
    models, out = run_experiment(verify_rejection, k=3, n_samples=N, seed=202, m=2)
    assert first_token_pvalue(models, out) > PASS
    assert joint_pvalue(models, out) > PASS


def test_rejection_one_hot_drafts_are_target():
    # k = 3 covers a rejection at the first position (the first token's marginal) and later ones (the joint)
    models, out = run_experiment(verify_rejection, k=3, n_samples=N, seed=303, one_hot=True, m=2)
    assert first_token_pvalue(models, out) > PASS
    assert joint_pvalue(models, out) > PASS


# Negative controls: the same harness detects wrong samplers, so the tests above can fail.


def always_accept(draft_tokens, draft_probs, target_probs, generator):
    k = len(draft_tokens)
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))


def resample_from_p_on_rejection(draft_tokens, draft_probs, target_probs, generator):
    """A classic bug: correct acceptance test, but the replacement is drawn from p instead of max(p - q, 0)."""
    for i, x in enumerate(draft_tokens.tolist()):
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if float(torch.rand(1, generator=generator)) * q_x >= float(target_probs[i, x]):
            return i, int(torch.multinomial(target_probs[i], 1, generator=generator))
    k = len(draft_tokens)
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))


# They run on a quarter of the samples: the test has the power to reject them even so.
N_CONTROL = N // 4


def test_negative_control_always_accept_is_detected():
    models, out = run_experiment(always_accept, k=1, n_samples=N_CONTROL, seed=101)
    assert first_token_pvalue(models, out) < FAIL
    models, out = run_experiment(always_accept, k=3, n_samples=N_CONTROL, seed=202, m=2)
    assert joint_pvalue(models, out) < FAIL


def test_negative_control_wrong_residual_is_detected():
    models, out = run_experiment(resample_from_p_on_rejection, k=1, n_samples=N_CONTROL, seed=101)
    assert first_token_pvalue(models, out) < FAIL
    models, out = run_experiment(resample_from_p_on_rejection, k=3, n_samples=N_CONTROL, seed=303, one_hot=True, m=2)
    assert joint_pvalue(models, out) < FAIL
