"""Tiny random-weight mixture-of-experts checkpoints (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next) saved with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.hf_hybrid import COMMON as HYBRID_COMMON
from turbospec.kv.plan import AttentionPlan
from turbospec.layers.moe import MoE

LINEAR = {k: v for k, v in HYBRID_COMMON.items() if k.startswith("linear_")}  # Gated DeltaNet sizes
COMMON = {**{k: v for k, v in HYBRID_COMMON.items() if k not in LINEAR}, "num_experts": 8, "num_experts_per_tok": 2,
          "moe_intermediate_size": 32}  # the hybrid tests' sizes, plus experts
HYBRID = {**LINEAR, "full_attention_interval": 2, "shared_expert_intermediate_size": 48}

VARIANTS = {
    # dense attention; layer 1 a plain MLP; top-k weights renormalised
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"mlp_only_layers": [1], "norm_topk_prob": True}),
    # every second layer MoE, top-3 weights as the router gives them (transformers' default)
    "qwen3_moe_sparse": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                         {"decoder_sparse_step": 2, "num_experts_per_tok": 3, "norm_topk_prob": False}),
    # Gated DeltaNet + gated attention, every layer MoE with a gated shared expert
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", HYBRID),
    # the same in Qwen3-Next's layout (in_proj_qkvz / in_proj_ba grouped per key head)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**HYBRID, "mlp_only_layers": []}),
}


def build(name: str, out: Path, mtp: bool = False, **over) -> Path:
    """A tiny checkpoint; `mtp`: add random `mtp.*` tensors whose layer is MoE too (as Qwen3.5-35B-A3B's); `over`:
    config fields changed (then the directory is named after them too)."""
    import transformers

    cfg_cls, model_cls, extra = VARIANTS[name]
    torch.manual_seed(sum(map(ord, name)))
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra, **over})
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # norms start at 0 (zero-centred) or 1: perturb them, A_log and dt_bias so they matter
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(("A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.3)
    path = out / (name + ("_mtp" if mtp else "") + "".join(f"_{k}{v}" for k, v in over.items()))
    model.save_pretrained(path)
    if mtp:
        f = path / "model.safetensors"
        sd = load_file(str(f))
        cfg_file = path / "config.json"
        d = json.loads(cfg_file.read_text())
        sd.update(mtp_tensors(d))
        save_file(sd, str(f))
        cfg_file.write_text(json.dumps({**d, "mtp_num_hidden_layers": 1}))
    return path


def mtp_tensors(text: dict) -> dict[str, torch.Tensor]:
    """One MTP layer (gated attention + MoE with shared expert) and its input projection, random."""
    g = torch.Generator().manual_seed(12)
    h, hd = text["hidden_size"], text["head_dim"]
    nq, nkv = text["num_attention_heads"], text["num_key_value_heads"]
    e, inter, si = text["num_experts"], text["moe_intermediate_size"], text["shared_expert_intermediate_size"]

    def r(*shape, s=0.1):
        return torch.randn(*shape, generator=g) * s

    p = "mtp.layers.0"
    t = {"mtp.fc.weight": r(h, 2 * h), "mtp.pre_fc_norm_embedding.weight": r(h), "mtp.pre_fc_norm_hidden.weight": r(h),
         "mtp.norm.weight": r(h), f"{p}.input_layernorm.weight": r(h), f"{p}.post_attention_layernorm.weight": r(h),
         f"{p}.self_attn.q_proj.weight": r(2 * nq * hd, h), f"{p}.self_attn.k_proj.weight": r(nkv * hd, h),
         f"{p}.self_attn.v_proj.weight": r(nkv * hd, h), f"{p}.self_attn.o_proj.weight": r(h, nq * hd),
         f"{p}.self_attn.q_norm.weight": r(hd), f"{p}.self_attn.k_norm.weight": r(hd),
         f"{p}.mlp.gate.weight": r(e, h), f"{p}.mlp.shared_expert_gate.weight": r(1, h),
         f"{p}.mlp.shared_expert.gate_proj.weight": r(si, h), f"{p}.mlp.shared_expert.up_proj.weight": r(si, h),
         f"{p}.mlp.shared_expert.down_proj.weight": r(h, si)}
    for i in range(e):
        t.update({f"{p}.mlp.experts.{i}.gate_proj.weight": r(inter, h), f"{p}.mlp.experts.{i}.up_proj.weight": r(inter, h),
                  f"{p}.mlp.experts.{i}.down_proj.weight": r(h, inter)})
    return t


def run(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits of `ids` placed after what `cache` holds (committed)."""
    h = model.forward(ids, AttentionPlan.causal(cache.length, ids.numel()), cache)
    cache.commit()
    return model.logits(h)


def prefill_then_decode(model, ids: torch.Tensor, prefill: int = 32, chunk: int = 8) -> torch.Tensor:
    """Logits of every position: `prefill` tokens in chunks, then one token at a time."""
    cache = model.new_cache(128)
    rows = [run(model, ids[s:s + chunk], cache) for s in range(0, prefill, chunk)]
    rows += [run(model, ids[t:t + 1], cache) for t in range(prefill, ids.numel())]
    return torch.cat(rows)


def moe_layers(model) -> list[MoE]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]


def batched_equals_single(model, seed: int) -> bool:
    """8 verification rows in one forward equal the same tokens decoded one at a time, bit for bit."""
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(seed))
    a, b = model.new_cache(64), model.new_cache(64)
    run(model, ids[:16], a)
    run(model, ids[:16], b)
    batched = run(model, ids[16:], a)
    single = torch.cat([run(model, ids[t:t + 1], b) for t in range(16, 24)])
    return torch.equal(batched, single)
