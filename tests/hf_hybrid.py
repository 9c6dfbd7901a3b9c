"""Tiny random-weight hybrid checkpoints (Qwen3.5 / Qwen3-Next) saved with transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

COMMON = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "initializer_range": 0.1,
}

VARIANTS = {
    # layer pattern from full_attention_interval: GDN, attention, GDN, attention
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {"full_attention_interval": 2}),
    # explicit layer_types, tied embeddings
    "qwen3_5_tied": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        {
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "tie_word_embeddings": True,
            "linear_num_value_heads": 2,
        },
    ),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {"num_experts": 0}),
    "qwen3_next_moe": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [1],
        },
    ),
}


def build(name: str, out: Path, **over) -> Path:
    """`over`: config fields changed from the variant's (sizes)."""
    import transformers

    cfg_cls, model_cls, extra = VARIANTS[name]
    torch.manual_seed(sum(map(ord, name)))
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra, **over})
    model = getattr(transformers, model_cls)(cfg).eval()
    with (
        torch.no_grad()
    ):  # norms start at 0 (zero-centred) or 1: perturb them, A_log and dt_bias so they matter
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(("A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.3)
    path = out / name
    model.save_pretrained(path)
    return path


def to_multimodal(src: Path, out: Path, mtp_layers: int = 1) -> Path:
    """Rewrite a Qwen3_5ForCausalLM checkpoint as the multimodal `qwen3_5` layout (model.language_model.*,
    a fake model.visual.* tensor, text_config nesting) and add random mtp.* tensors."""
    out.mkdir(parents=True, exist_ok=True)
    text = json.loads((src / "config.json").read_text())
    cfg = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"depth": 1},
        "tie_word_embeddings": text["tie_word_embeddings"],
    }
    (out / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(src / "model.safetensors"))
    new = {}
    for k, v in sd.items():
        new[k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k] = v
    new["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
    new.update(mtp_tensors(text, mtp_layers))
    save_file(new, str(out / "model.safetensors"))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy(f, out / f.name)
    return out


def mtp_tensors(text: dict, layers: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    h, hd = text["hidden_size"], text["head_dim"]
    nq, nkv, inter = text["num_attention_heads"], text["num_key_value_heads"], text["intermediate_size"]

    def r(*shape, s=0.1):
        return torch.randn(*shape, generator=g) * s

    t = {
        "mtp.fc.weight": r(h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": r(h),
        "mtp.pre_fc_norm_hidden.weight": r(h),
        "mtp.norm.weight": r(h),
    }
    for i in range(layers):
        p = f"mtp.layers.{i}"
        t.update(
            {
                f"{p}.input_layernorm.weight": r(h),
                f"{p}.post_attention_layernorm.weight": r(h),
                f"{p}.self_attn.q_proj.weight": r(2 * nq * hd, h),
                f"{p}.self_attn.k_proj.weight": r(nkv * hd, h),
                f"{p}.self_attn.v_proj.weight": r(nkv * hd, h),
                f"{p}.self_attn.o_proj.weight": r(h, nq * hd),
                f"{p}.self_attn.q_norm.weight": r(hd),
                f"{p}.self_attn.k_norm.weight": r(hd),
                f"{p}.mlp.gate_proj.weight": r(inter, h),
                f"{p}.mlp.up_proj.weight": r(inter, h),
                f"{p}.mlp.down_proj.weight": r(h, inter),
            }
        )
    return t
