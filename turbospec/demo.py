"""Build random-weight Qwen3-style checkpoints locally (no hub): the benchmark shape and tiny test models."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

BENCH_SHAPE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
                   "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 32000}


def qwen3_config(**over) -> dict:
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": True,
        "attention_bias": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "bos_token_id": None, "eos_token_id": 1, "torch_dtype": "bfloat16",
    }
    cfg.update(BENCH_SHAPE)
    cfg.update(over)
    return cfg


def random_qwen3_weights(cfg: dict, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    t = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}"
        t.update({
            f"{p}.self_attn.q_proj.weight": w(nh * hd, h), f"{p}.self_attn.k_proj.weight": w(nkv * hd, h),
            f"{p}.self_attn.v_proj.weight": w(nkv * hd, h), f"{p}.self_attn.o_proj.weight": w(h, nh * hd),
            f"{p}.self_attn.q_norm.weight": torch.ones(hd, dtype=dtype),
            f"{p}.self_attn.k_norm.weight": torch.ones(hd, dtype=dtype),
            f"{p}.mlp.gate_proj.weight": w(i, h), f"{p}.mlp.up_proj.weight": w(i, h),
            f"{p}.mlp.down_proj.weight": w(h, i),
            f"{p}.input_layernorm.weight": torch.ones(h, dtype=dtype),
            f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        })
    if not cfg.get("tie_word_embeddings", True):
        t["lm_head.weight"] = w(v, h)
    return t


def byte_tokenizer(out: Path) -> None:
    """A byte-level tokenizer (256 byte tokens + chat specials, no merges): enough to drive a random model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, "<|im_end|>": 1, "<|im_start|>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_end|>", "<|im_start|>"])
    tok.save(str(out / "tokenizer.json"))
    tmpl = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": None, "chat_template": tmpl, "model_max_length": 40960,
    }, indent=2))


def write_checkpoint(out: str | Path, cfg: dict, weights: dict[str, torch.Tensor]) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    byte_tokenizer(out)
    return out


def make_demo_model(out: str | Path, seed: int = 0, **over) -> Path:
    cfg = qwen3_config(**over)
    return write_checkpoint(out, cfg, random_qwen3_weights(cfg, seed))
