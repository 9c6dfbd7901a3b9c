"""The planted induction circuit copies at initialisation, at short and long distance, and only where asked."""

import pytest
import torch

from training.induction_init import plant_induction_circuit
from training.model import TrunkWithMTP, build_config


def _model(plant: bool, theta: float = 1e8):
    cfg = build_config("qwen3", 2048, hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, intermediate=256,
                       rope_theta=theta)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = TrunkWithMTP(cfg, "qwen3")
    if plant:
        plant_induction_circuit(m)
    return m.eval()


def _planted(vocab: int = 8192, heads: int = 4, theta: float = 1e12, **plant):
    """A 2-layer qwen3 (hidden 256, ``heads`` query heads over 2 key-value heads of 64) with the circuit planted
    as ``plant`` asks; returns the model in eval mode and the planted settings."""
    cfg = build_config("qwen3", vocab, hidden=256, layers=2, heads=heads, kv_heads=2, head_dim=64, intermediate=256,
                       rope_theta=theta)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = TrunkWithMTP(cfg, "qwen3")
    planted = plant_induction_circuit(m, **plant)
    return m.eval(), planted


@torch.no_grad()
def _copy_top1(m, gap: int, half: int = 24) -> float:
    g = torch.Generator().manual_seed(1)
    h = torch.randint(10, 2048, (2, half), generator=g)
    x = torch.cat([h, torch.randint(10, 2048, (2, gap), generator=g), h], 1)
    pred = m.lm(input_ids=x).logits.argmax(-1)
    return (pred[:, -half:-1] == x[:, -half + 1:]).float().mean().item()


@pytest.mark.parametrize("gap,floor", [(0, 0.8), (900, 0.6)])  # hidden 128: noisier than the real 256
def test_planted_circuit_copies(gap, floor):
    assert _copy_top1(_model(True), gap) > floor
    assert _copy_top1(_model(False), gap) < 0.1


def test_planted_circuit_keeps_predictions_shift_invariant_and_rejects_hybrid():
    m = _model(True)
    assert m.lm.model.layers[1].mlp.down_proj.weight.abs().sum() == 0  # other outputs start at zero
    cfg = build_config("qwen3_5_text", 256, hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, intermediate=64,
                       linear_heads=2, linear_head_dim=32)
    with pytest.raises(ValueError, match="dense qwen3"):
        plant_induction_circuit(TrunkWithMTP(cfg, "qwen3_5_text"))


def test_circuit_guard_holds_the_first_two_layers_only():
    from training.induction_init import CircuitGuard

    cfg = build_config("qwen3", 512, hidden=128, layers=3, heads=2, kv_heads=1, head_dim=64, intermediate=128,
                       rope_theta=1e8)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = TrunkWithMTP(cfg, "qwen3")
    plant_induction_circuit(m)
    guard = CircuitGuard(m)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    loss, _, _ = m(torch.randint(0, 512, (2, 32)))
    loss.backward()
    opt.step()
    guard.restore()
    after = dict(m.named_parameters())
    held = [n for n in before if n.startswith(("lm.model.layers.0.", "lm.model.layers.1."))]
    assert held and all(torch.equal(before[n], after[n]) for n in held)
    assert not torch.equal(before["lm.model.layers.2.mlp.up_proj.weight"], after["lm.model.layers.2.mlp.up_proj.weight"])
    assert not torch.equal(before["lm.model.embed_tokens.weight"], after["lm.model.embed_tokens.weight"])


@torch.no_grad()
def test_two_token_context_resolves_a_shared_predecessor():
    """Many earlier `<a_i> B <x_i>` triples share B: matching B alone cannot tell which x follows `A B`;
    the 2-token circuit can."""

    g = torch.Generator().manual_seed(2)
    docs = []
    for _ in range(12):
        triples = torch.randint(10, 2048, (20, 3), generator=g)
        triples[:, 1] = 5  # the shared middle token
        a, x = triples[7, 0], triples[7, 2]
        docs.append((torch.cat([triples.flatten(), torch.tensor([a, 5])]), x))
    hits = {}
    for context in (1, 2):
        m, _ = _planted(2048, heads=2, theta=1e8, context=context, k=32 // context)
        hits[context] = sum(int(m.lm(input_ids=d[None]).logits[0, -1].argmax() == x) for d, x in docs)
    assert hits[2] >= 7 and hits[1] <= 2, hits  # measured: 9 and 0 of 12


@torch.no_grad()
def test_offset_four_tells_rows_apart_that_share_the_last_three_tokens():
    """Rows `R n1 n2 B1 B2 B3 C v...` (like `Account 70 balance: 93,...`, which this tokenizer ends
    `0 | b | al | ance | :`): matching the current token and its predecessor cannot tell which row is asked;
    offsets (0, 1, 4) reach the account number."""

    g = torch.Generator().manual_seed(2)
    docs = []
    for _ in range(16):
        nums = (torch.randperm(90, generator=g)[:6] + 10).tolist()
        vals = torch.randint(100, 8192, (6, 3), generator=g)
        ids = []
        for n, v in zip(nums, vals):
            ids += [11, 20 + n // 10, 20 + n % 10, 12, 13, 14, 15, *v.tolist()]
            ids += torch.randint(100, 8192, (10,), generator=g).tolist()
        n = nums[3]
        docs.append((torch.tensor(ids + [11, 20 + n // 10, 20 + n % 10, 12, 13, 14, 15]), vals[3, 0]))
    hits = {}
    for offsets, theta, k in (((0, 1), 1e8, 16), ((0, 1, 4), 1e12, 14)):
        m, planted = _planted(theta=theta, offsets=offsets, k=k)
        assert planted["offsets"] == list(offsets)
        hits[offsets] = sum(int(m.lm(input_ids=d[None]).logits[0, -1].argmax() == x) for d, x in docs)
    assert hits[(0, 1, 4)] >= 10 and hits[(0, 1)] <= 5, hits  # measured: 12 and 1 of 16


def test_offsets_need_one_layer0_head_per_lookback_distance():
    cfg = build_config("qwen3", 512, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=128,
                       rope_theta=1e12)
    m = TrunkWithMTP(cfg, "qwen3")
    with pytest.raises(ValueError, match=r"look-back distance \[1, 2, 4, 5, 6\]"):
        plant_induction_circuit(m, offsets=(0, 1, 4, 5), k=10)  # needs 5 look-back heads, layer 0 has 4
    with pytest.raises(ValueError, match=r"look-back distance \[1, 2, 3, 4, 5\]"):
        plant_induction_circuit(m, offsets=(0, 1, 4), k=14, more_offsets=((0, 1, 2),))
    with pytest.raises(ValueError, match="an induction head per key-value group"):
        plant_induction_circuit(m, offsets=(0, 1), more_offsets=((0, 2), (0, 3)))


@torch.no_grad()
def test_a_second_local_induction_head_copies_digits_inside_a_number():
    """Rows `R n1 n2 B1 B2 B3 C d , d d , d d` (like `Account 42 balance: 20,724,930`): inside the value the
    token four back is the row's shared prefix or a digit many rows share, so (0, 1, 4) alone mixes rows up;
    a second induction head matching (0, 1, 2), in the other key-value group, copies the digits."""

    g = torch.Generator().manual_seed(3)
    docs = []
    for _ in range(16):
        nums = (torch.randperm(90, generator=g)[:6] + 10).tolist()
        ids = []
        for n in nums:
            d = torch.randint(20, 30, (5,), generator=g).tolist()
            value = [d[0], 16, d[1], d[2], 16, d[3], d[4]]
            ids += [11, 20 + n // 10, 20 + n % 10, 12, 13, 14, 15, *value]
            ids += torch.randint(100, 8192, (10,), generator=g).tolist()
        asked = 3 * (7 + 7 + 10)  # the 4th row starts here
        docs.append((torch.tensor(ids + ids[asked:asked + 14]), 7))
    whole = {}
    for more in ((), ((0, 1, 2),)):
        m, planted = _planted(heads=6, offsets=(0, 1, 4), k=14, more_offsets=more)
        assert planted.get("more_offsets", []) == [list(o) for o in more]
        hits = 0
        for x, n_value in docs:
            pred = m.lm(input_ids=x[None]).logits[0].argmax(-1)
            hits += int(torch.equal(pred[-n_value - 1:-1], x[-n_value:]))
        whole[more] = hits
    assert whole[((0, 1, 2),)] >= 7 and whole[()] <= 5, whole  # measured: 9 and 3 of 16
