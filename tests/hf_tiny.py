"""Tiny random-weight transformers checkpoints for exactness tests (test-only dependency on transformers)."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 512}

PHI3_IDS = {"pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}  # (Phi3Config's defaults are Phi-3's 32000)

VARIANTS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "tie_word_embeddings": False}),
    "qwen3_tied_bias": ("Qwen3Config", "Qwen3ForCausalLM",
                        {"head_dim": 24, "tie_word_embeddings": True, "attention_bias": True}),
    "qwen3_gqa3": ("Qwen3Config", "Qwen3ForCausalLM",  # 3 query heads per KV head, like the bundled model
                   {"head_dim": 16, "num_attention_heads": 6, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 1}),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        "attention_bias": True, "mlp_bias": True}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"tie_word_embeddings": False, "sliding_window": None,
                                               "original_max_position_embeddings": 512, **PHI3_IDS}),
    # Phi-4-mini's partial rotary and tied embeddings; Phi-3-mini's sliding window
    "phi3_partial": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5, "tie_word_embeddings": True,
                                                       "sliding_window": 64, "original_max_position_embeddings": 512,
                                                       **PHI3_IDS}),
    # Phi-3.5's LongRoPE: short / long per-frequency factors, 32 pretrained positions of 512
    "phi3_long": ("Phi3Config", "Phi3ForCausalLM", {
        "tie_word_embeddings": False, "sliding_window": None, **PHI3_IDS, "original_max_position_embeddings": 32,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]}}),
    "qwen3_yarn": ("Qwen3Config", "Qwen3ForCausalLM", {
        "head_dim": 16, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 32}}),
}


def build(name: str, out: Path) -> Path:
    import transformers

    cfg_cls, model_cls, extra = VARIANTS[name]
    torch.manual_seed(sum(map(ord, name)))  # (not hash(): Python salts str hashes per process, so the models varied)
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # norms default to ones; perturb them so the test sees their effect
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path = out / name
    model.save_pretrained(path)
    return path


def build_all(out: Path) -> dict[str, Path]:
    return {name: build(name, out) for name in VARIANTS}


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(ids[None]).logits[0].float()
