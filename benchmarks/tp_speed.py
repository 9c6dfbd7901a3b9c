"""Tensor parallelism on this machine: `turbospec run` in one process (T threads) against `turbospec run --tp N`
(N ranks of T/N threads each under torchrun), on a random dense Qwen3 or hybrid Qwen3.5 checkpoint, alternating,
median of the rounds; decode and prefill t/s, the weights each rank holds and every rank's peak memory (issue #29
item 4).

    python benchmarks/tp_speed.py --rounds 5 --out docs/results/tp_speed.json
    python benchmarks/tp_speed.py --arch hybrid --rounds 5 --out docs/results/tp_speed_hybrid.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def weight_mib(model: Path, rank: int, ranks: int) -> float:
    """MiB of weight tensors rank `rank` of `ranks` holds in float32 (what `load_model_tp` builds, no group needed)."""
    import torch

    from turbospec.model.loader import WeightSource, load_config
    from turbospec.model.registry import build_model
    from turbospec.parallel.tp import ShardedSource, shard_config

    cfg = load_config(model)
    if ranks == 1:
        built = build_model(cfg, WeightSource(model), torch.float32)
    else:
        local = shard_config(cfg, ranks)
        built = build_model(local, ShardedSource(WeightSource(model), rank, ranks, local, cfg.num_kv_heads),
                            torch.float32)
    return built.weight_bytes / 2**20


def dense_model(out: Path, hidden: int, layers: int) -> Path:
    """A random Qwen3 checkpoint (bf16) with a byte tokenizer."""
    from turbospec.demo import make_demo_model

    return make_demo_model(out, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                           num_hidden_layers=layers, num_attention_heads=hidden // 128,
                           num_key_value_heads=max(2, hidden // 384), head_dim=128, vocab_size=32000)


def hybrid_model(out: Path, hidden: int, layers: int) -> Path:
    """A random Qwen3.5-shaped hybrid (three Gated DeltaNet layers per attention layer; bf16, transformers' own
    initialisation) with a byte tokenizer."""
    import torch
    import transformers

    from turbospec.demo import byte_tokenizer

    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(
        hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64, num_hidden_layers=layers,
        num_attention_heads=hidden // 128, num_key_value_heads=max(2, hidden // 384), head_dim=128,
        linear_num_key_heads=hidden // 192, linear_num_value_heads=hidden // 96, linear_key_head_dim=128,
        linear_value_head_dim=128, vocab_size=32000, full_attention_interval=4, tie_word_embeddings=False)
    transformers.Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    byte_tokenizer(out)
    return out


def run_once(model: Path, ranks: int, threads: int, n: int, prompt: str, tmp: Path) -> list[dict]:
    stats = tmp / f"stats-{ranks}.json"
    flags = ["run", "-m", str(model), "-n", str(n), "--temp", "0", "-p", prompt, "--no-echo", "--ignore-eos",
             "-t", str(threads // ranks), "--json-stats", str(stats), "--tp", str(ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads // ranks)}
    cmd = [sys.executable, "-m", "turbospec.cli", *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd[:8])} ... failed:\n{r.stderr[-3000:]}")
    files = [stats] + [Path(f"{stats}.rank{r}") for r in range(1, ranks)]
    return [json.loads(f.read_text()) for f in files]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--arch", choices=("dense", "hybrid"), default="dense")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = (hybrid_model if a.arch == "hybrid" else dense_model)(tmp / "m", a.hidden, a.layers)
        weights_mib = {1: [weight_mib(model, 0, 1)], a.ranks: [weight_mib(model, r, a.ranks) for r in range(a.ranks)]}
        params = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2  # written in bfloat16
        prompt = "The history of the city begins " * 8
        results: dict[int, list[list[dict]]] = {1: [], a.ranks: []}
        for r in range(a.rounds):
            for ranks in (1, a.ranks):
                results[ranks].append(run_once(model, ranks, a.threads, a.n, prompt, tmp))
                st = results[ranks][-1][0]
                print(f"round {r} ranks {ranks}: decode {st['decode_tps']:.2f} t/s, prefill {st['prefill_tps']:.1f} "
                      f"t/s, peak {[round(x['peak_rss_bytes'] / 2**20) for x in results[ranks][-1]]} MiB",
                      file=sys.stderr)
    rows = []
    for ranks, runs in results.items():
        rows.append({
            "ranks": ranks, "threads_per_rank": a.threads // ranks,
            "decode_tps": statistics.median(x[0]["decode_tps"] for x in runs),
            "decode_tps_all": [x[0]["decode_tps"] for x in runs],
            "prefill_tps": statistics.median(x[0]["prefill_tps"] for x in runs),
            "peak_rss_mib_per_rank": [statistics.median(x[i]["peak_rss_bytes"] / 2**20 for x in runs)
                                      for i in range(ranks)],
            "weights_mib_per_rank": weights_mib[ranks],
        })
    report = {"model": {"arch": a.arch, "params": params, "hidden": a.hidden, "layers": a.layers},
              "n": a.n, "rounds": a.rounds, "rows": rows}
    print(json.dumps(report, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
