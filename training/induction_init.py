"""A structured initialisation: the first two layers start as an induction circuit (in-context copying).

In-context copying -- "find the earlier occurrence of the current token, predict what followed it" -- is two
heads composed: a *previous-token head* that writes each position's predecessor into the residual stream, and
an *induction head* that matches the current token against it and copies the token found.  Trained from
random weights on 2 CPU cores, a small model stays on the loss plateau before that circuit forms for longer
than the whole training budget (docs/bundled-model.md, "Why retrieval fails").  This module plants the
circuit at initialisation (``context=2`` or ``offsets=(0, 1, 4)`` add look-back heads so that more earlier
tokens are matched; see :func:`plant_induction_circuit`); :class:`CircuitGuard` lets the trainer hold layers 0-1 fixed afterwards.

Dense ``qwen3`` attention: per-head RMSNorm on q and k (weights shared by the layer's heads), then RoPE with
rotate-half pairs (i, i + D/2), pair i turning by ``theta_i = base ** (-2i/D)`` per position.

* Every token embedding gets a shared component ``c * u``: a constant direction attention can read (with tied
  embeddings it adds the same amount to every logit, so it changes no prediction).
* **previous-token head** (layer 0, head 0): its query and its group's key rows read only ``u``, so after the
  q/k norms they are fixed vectors; the query sits on the ``fast_pairs`` highest-frequency rotary pairs at
  angle 0 and the key on the same pairs turned forward by one position, so the score
  ``sum_i cos((t - s - 1) theta_i)`` peaks at s = t - 1.  Value: the token's coordinates in a random
  ``k``-dim subspace S; output: written into another subspace T (orthogonal to S and u) with gain ``alpha``.
* **induction head** (layer 1, head 0): the query reads the current token's S-coordinates, the key reads
  T (the predecessor written there), both placed on the *slowest* rotary pairs (they barely turn over
  thousands of positions, so the match does not depend on distance); the value reads the token in a
  subspace orthogonal to T and u and the output writes it back with gain ``gamma``: the copied token's
  logit goes up through the tied embeddings.
* Output projections of every other head and every MLP start at zero (a common choice for deep residual
  networks) so that, at the start, nothing else writes into the stream the circuit reads.
The two layers' q/k norm weights are raised to sharpen the softmax (the other heads of those layers just start
at a higher temperature).  RoPE ``base`` must be large enough that ``k / 2`` pairs are slow over the training
context; the trainer uses 1e8.
"""

from __future__ import annotations

import torch


def _orthonormal_rows(n: int, d: int, g: torch.Generator, avoid: torch.Tensor | None = None) -> torch.Tensor:
    """n orthonormal rows in R^d, orthogonal to the rows of ``avoid``."""
    m = torch.randn(d, n + (0 if avoid is None else avoid.shape[0]), generator=g)
    if avoid is not None:
        m[:, :avoid.shape[0]] = avoid.T
    q, _ = torch.linalg.qr(m)
    return q[:, (0 if avoid is None else avoid.shape[0]):].T.contiguous()


def lookback_distances(*offset_sets) -> list[int]:
    """Layer-0 look-back heads a circuit needs for induction heads matching ``offset_sets``: a query reads the token
    ``o`` back (offset >= 1) and a key the token ``o + 1`` back, so every offset >= 1 and every offset + 1."""
    return sorted({d for offsets in offset_sets for o in offsets for d in (o, o + 1) if d >= 1})


@torch.no_grad()
def plant_induction_circuit(model, k: int = 32, fast_pairs: int = 4, c: float = 0.3, alpha: float = 0.05,
                            gamma: float = 0.3, norm_scale: float = 2.5, zero_outputs: bool = True,
                            seed: int = 0, context: int = 1,
                            offsets: tuple[int, ...] | None = None,
                            more_offsets: tuple[tuple[int, ...], ...] = ()) -> dict:
    """Initialise ``model.lm`` (a transformers Qwen3ForCausalLM) in place; returns the planted settings.

    ``context`` = how many tokens the induction head matches: 1 (the current token against each position's
    predecessor), 2 (also the token before: a second layer-0 head, in the other key-value group, looks back
    two positions and writes into its own subspace T2; query and key get one block of ``k`` slow dims per
    token).  Two tokens tell ``is $`` from ``Juniper: $`` and ``653,`` from ``76,`` in number-dense text.
    ``offsets`` (default ``range(context)``) names which earlier tokens are matched, e.g. ``(0, 1, 4)``: the
    current token, its predecessor and the token four back -- with this tokenizer ``Account 70 balance:``
    ends ``0 | b | al | ance | :``, so only a match that reaches four back tells the rows apart.  Each look-back
    distance needed (every offset >= 1 and every offset + 1) takes one layer-0 head.
    ``more_offsets`` adds further induction heads in layer 1, one per key-value group (the first head of group
    1, 2, ...), each matching its own offsets, e.g. ``((0, 1, 2),)`` beside ``(0, 1, 4)``: a purely local match
    for the digits inside a number, where four back lands on the row's shared prefix.  Their outputs add up, so
    a token both heads find wins over one only the ambiguous head finds.
    """
    lm = model.lm
    cfg = lm.config
    if cfg.model_type != "qwen3":
        raise ValueError(f"induction init supports the dense qwen3 trunk, not {cfg.model_type!r}")
    d, hd = cfg.hidden_size, cfg.head_dim
    half = hd // 2
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    offsets = tuple(offsets) if offsets is not None else tuple(range(context))
    sets = [offsets, *(tuple(o) for o in more_offsets)]
    dists = lookback_distances(*sets)
    n_kv = cfg.num_key_value_heads
    if (cfg.num_hidden_layers < 2 or k % 2 or len(sets) > n_kv
            or any(not o or min(o) < 0 or len(set(o)) < len(o) or not 0 < fast_pairs <= half - k // 2 * len(o)
                   for o in sets) or len(dists) > cfg.num_attention_heads):
        raise ValueError("need >= 2 layers, an even k, distinct offsets >= 0, k/2 * len(offsets) <= head_dim/2 - "
                         f"fast_pairs, an induction head per key-value group ({n_kv}), and a layer-0 head per "
                         f"look-back distance {dists}")
    g = torch.Generator().manual_seed(seed)
    u = _orthonormal_rows(1, d, g)                      # [1, d] shared direction
    s_rows = _orthonormal_rows(k, d, g, avoid=u)        # S: what the look-back heads read
    t_rows: dict[int, torch.Tensor] = {}                # T_d: where the look-back-d head writes
    for dist in dists:
        t_rows[dist] = _orthonormal_rows(k, d, g, avoid=torch.cat([u, s_rows, *t_rows.values()]))
    v_rows = _orthonormal_rows(hd, d, g, avoid=torch.cat([u, *t_rows.values()]))  # what the induction head copies
    layers = lm.model.layers
    if zero_outputs:
        for layer in layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    emb = lm.model.embed_tokens.weight
    emb += c * u[0].to(emb.dtype)
    theta = cfg.rope_parameters["rope_theta"] ** (-torch.arange(0, hd, 2).float() / hd)

    def block(j: int) -> list[int]:
        """Dims of the j-th block of k/2 slow pairs (both halves of each pair); block 0 is the slowest."""
        lo = half - k // 2 * (j + 1)
        return list(range(lo, lo + k // 2)) + list(range(half + lo, half + lo + k // 2))

    def put(lin, rows_at: slice, w: torch.Tensor):
        lin.weight[rows_at] = w.to(lin.weight.dtype)

    # layer 0: one look-back head per distance, spread over the key-value groups (head 0, the first head of
    # group 1, ..., then the second head of group 0, ...).  Group g's key reads u turned forward by g + 1
    # positions; a head's query is turned back by the rest of its distance: the score peaks where
    # (t - s) * theta = key angle - query angle.
    a0 = layers[0].self_attn
    for i, dist in enumerate(dists):
        kv = i % n_kv
        head = kv * group + i // n_kv
        q_angle = -(dist - kv - 1) * theta[:fast_pairs]
        q0, k0 = torch.zeros(hd), torch.zeros(hd)
        q0[:fast_pairs] = torch.cos(q_angle)
        q0[half:half + fast_pairs] = torch.sin(q_angle)
        k0[:fast_pairs] = torch.cos((kv + 1) * theta[:fast_pairs])
        k0[half:half + fast_pairs] = torch.sin((kv + 1) * theta[:fast_pairs])
        put(a0.q_proj, slice(head * hd, (head + 1) * hd), torch.outer(q0, u[0]))
        put(a0.k_proj, slice(kv * hd, (kv + 1) * hd), torch.outer(k0, u[0]))
        v0 = torch.zeros(hd, d)
        v0[:k] = s_rows
        put(a0.v_proj, slice(kv * hd, (kv + 1) * hd), v0)
        o0 = torch.zeros(d, hd)
        o0[:, :k] = alpha * t_rows[dist].T
        a0.o_proj.weight[:, head * hd:(head + 1) * hd] = o0.to(a0.o_proj.weight.dtype)
    # layer 1: induction heads, the first head of each key-value group.  Query block j = the token at t - o_j
    # (S at t for offset 0, else T_o at t); key block j = the token at s - 1 - o_j (T_{o+1} at s).
    a1 = layers[1].self_attn
    for kv, offs in enumerate(sets):
        head = kv * group
        q1, k1 = torch.zeros(hd, d), torch.zeros(hd, d)
        for j, o in enumerate(offs):
            q1[block(j)] = s_rows if o == 0 else t_rows[o]
            k1[block(j)] = t_rows[o + 1]
        put(a1.q_proj, slice(head * hd, (head + 1) * hd), q1)
        put(a1.k_proj, slice(kv * hd, (kv + 1) * hd), k1)
        put(a1.v_proj, slice(kv * hd, (kv + 1) * hd), v_rows)
        a1.o_proj.weight[:, head * hd:(head + 1) * hd] = (gamma * v_rows.T).to(a1.o_proj.weight.dtype)
    for a in (a0, a1):
        a.q_norm.weight.fill_(norm_scale)
        a.k_norm.weight.fill_(norm_scale)
    return {"k": k, "fast_pairs": fast_pairs, "embed_shift": c, "alpha": alpha, "gamma": gamma,
            "qk_norm_scale": norm_scale, "zero_outputs": zero_outputs, "rope_theta": cfg.rope_parameters["rope_theta"],
            "context": len(offsets), "offsets": list(offsets),
            **({"more_offsets": [list(o) for o in sets[1:]]} if len(sets) > 1 else {})}


class CircuitGuard:
    """Holds the first two layers (the planted circuit) fixed through training: restore after every step.

    Held whole, so that their other heads and MLPs keep writing nothing: trained freely, the rest of those
    layers grows outputs hundreds of times the embedding's size within ~100 steps at lr 1.5e-3..3e-3 and the
    circuit, which reads the stream through RMSNorm, drowns (measured: copying gone by step 75).
    """

    def __init__(self, model, layers: int = 2):
        self.saved = [(p, p.detach().clone()) for layer in model.lm.model.layers[:layers] for p in layer.parameters()]

    @torch.no_grad()
    def restore(self) -> None:
        for p, v in self.saved:
            p.copy_(v)
