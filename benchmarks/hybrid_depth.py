"""Decode speed vs context depth: hybrid (Gated DeltaNet + gated attention) vs dense, same shape.

Both models use the engine-core benchmark shape (hidden 512, 8 layers, 8 heads, 2 KV heads, head_dim 64,
intermediate 1536, vocab 32000, tied embeddings, random weights). The dense one is Qwen3 (8 attention layers);
the hybrid one is Qwen3.5-style (`qwen3_5_text`, full_attention_interval 4: 6 GDN + 2 gated-attention
layers, partial rotary 0.25) with Qwen3-Next GDN proportions: 4 key heads / 8 value heads x 128 dims
(key dim = hidden, value dim = 2 x hidden), conv kernel 4.

Depth is reached cheaply: the attention KV cache is filled with random K/V for `depth` positions and its
length set (no 32K-token prefill); the GDN conv/recurrent states are random too (their size does not depend on
depth).
Then `--steps` greedy decode steps (forward of 1 token + logits + argmax + commit) are timed one by one after
`--warmup` untimed steps; the table reports the median per-token time as t/s.

    python benchmarks/hybrid_depth.py [--depths 1024 8192 32768] [--steps 48] [--dtype bfloat16]
                                      [--out docs/results/hybrid_depth.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from turbospec.demo import qwen3_config, random_qwen3_weights
from turbospec.dtypes import parse_dtype
from turbospec.kv.hybrid_cache import HybridCache
from turbospec.kv.plan import AttentionPlan
from turbospec.model import load_model

GDN = {"linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 128,
       "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def hybrid_config() -> dict:
    cfg = qwen3_config(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"],
                       full_attention_interval=4, **GDN)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25}
    return cfg


def random_hybrid_weights(cfg: dict, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, kern = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]

    def w(*shape, s=0.02):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    def zeros(*shape):
        return torch.zeros(*shape, dtype=dtype)

    t = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": zeros(h)}
    every = cfg["full_attention_interval"]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}"
        if (n + 1) % every == 0:
            t.update({
                f"{p}.self_attn.q_proj.weight": w(2 * nh * hd, h),
                f"{p}.self_attn.k_proj.weight": w(nkv * hd, h),
                f"{p}.self_attn.v_proj.weight": w(nkv * hd, h), f"{p}.self_attn.o_proj.weight": w(h, nh * hd),
                f"{p}.self_attn.q_norm.weight": zeros(hd), f"{p}.self_attn.k_norm.weight": zeros(hd),
            })
        else:
            conv_dim = 2 * nk * dk + nv * dv
            q = f"{p}.linear_attn"
            t.update({
                f"{q}.in_proj_qkv.weight": w(conv_dim, h), f"{q}.in_proj_z.weight": w(nv * dv, h),
                f"{q}.in_proj_b.weight": w(nv, h), f"{q}.in_proj_a.weight": w(nv, h),
                f"{q}.conv1d.weight": w(conv_dim, 1, kern, s=0.3), f"{q}.A_log": torch.rand(nv, generator=g),
                f"{q}.dt_bias": torch.ones(nv), f"{q}.norm.weight": torch.ones(dv, dtype=dtype),
                f"{q}.out_proj.weight": w(h, nv * dv),
            })
        t.update({
            f"{p}.mlp.gate_proj.weight": w(i, h), f"{p}.mlp.up_proj.weight": w(i, h),
            f"{p}.mlp.down_proj.weight": w(h, i),
            f"{p}.input_layernorm.weight": zeros(h), f"{p}.post_attention_layernorm.weight": zeros(h),
        })
    return t


def write(path: Path, cfg: dict, tensors: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def fill_to_depth(cache, depth: int, gen: torch.Generator) -> None:
    kv = cache.kv if isinstance(cache, HybridCache) else cache  # a hybrid's attention layers have their own KV
    kv.k[:, :, :depth] = torch.randn(kv.k[:, :, :depth].shape, generator=gen).to(kv.k.dtype)
    kv.v[:, :, :depth] = torch.randn(kv.v[:, :, :depth].shape, generator=gen).to(kv.v.dtype)
    kv.length = depth
    if kv is not cache:
        cache.conv.copy_(torch.randn(cache.conv.shape, generator=gen))
        cache.ssm.copy_(torch.randn(cache.ssm.shape, generator=gen) * 0.1)


def decode_times(model, depth: int, steps: int, warmup: int) -> tuple[list[float], object]:
    cache = model.new_cache(depth + steps + warmup + 8)
    fill_to_depth(cache, depth, torch.Generator().manual_seed(depth))
    tok = torch.tensor([7])
    times = []
    for s in range(warmup + steps):
        t = time.perf_counter()
        h = model.forward(tok, AttentionPlan.causal(cache.length, 1), cache)
        tok = model.logits(h).argmax(-1)
        cache.commit()
        if s >= warmup:
            times.append(time.perf_counter() - t)
    return times, cache


def params(model) -> int:
    return model.weight_bytes // model.embed.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dt = parse_dtype(a.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dense_cfg = qwen3_config()
        paths = {
            "dense": write(Path(tmp) / "dense", dense_cfg, random_qwen3_weights(dense_cfg, 0, dt)),
            "hybrid": write(Path(tmp) / "hybrid", hybrid_config(),
                            random_hybrid_weights(hybrid_config(), 0, dt)),
        }
        models = {k: load_model(p, a.dtype) for k, p in paths.items()}
    for name, m in models.items():
        print(f"{name}: {params(m) / 1e6:.1f}M params, {m.weight_bytes / 2**20:.1f} MiB weights ({a.dtype})")
    print(f"{'model':7} {'depth':>6} {'t/s (median)':>13} {'ms/tok':>8} {'attn KV MiB':>12}"
          f" {'recurrent KiB':>14}")
    for depth in a.depths:
        for name, m in models.items():
            times, cache = decode_times(m, depth, a.steps, a.warmup)
            med = statistics.median(times)
            hybrid = isinstance(cache, HybridCache)
            kv_bytes = cache.attention_kv_bytes if hybrid else cache.nbytes
            rec = cache.recurrent_state_bytes if hybrid else 0
            per_tok = cache.bytes_per_token()
            row = {"model": name, "depth": depth, "tps_median": 1 / med, "ms_median": med * 1e3,
                   "ms_all": [x * 1e3 for x in times], "attention_kv_bytes_at_depth": per_tok * depth,
                   "attention_kv_bytes_per_token": per_tok, "recurrent_state_bytes": rec,
                   "cache_alloc_bytes": kv_bytes + rec, "weight_bytes": m.weight_bytes}
            rows.append(row)
            print(f"{name:7} {depth:6d} {1 / med:13.1f} {med * 1e3:8.2f} {per_tok * depth / 2**20:12.1f}"
                  f" {rec / 2**10:14.1f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        meta = {"dtype": a.dtype, "steps": a.steps, "threads": torch.get_num_threads()}
        Path(a.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
