"""What each GGUF weight type costs in quality: the checkpoint exported (`turbospec export-gguf`) or quantized by
llama.cpp's `llama-quantize --pure` (K-quants), loaded back by turbospec (dequantized to float32), and compared with
the float32 checkpoint on the shipped prose text the llama-perplexity way (chunks of --ctx tokens, the second half
of each scored): mean / p99 KL divergence, top-1 agreement and perplexity, with the file's bits per weight.
With `--llama-server PATH`, llama.cpp runs each file too, and the top-1 token of both engines on the same file is
compared at `--llama-positions` positions per chunk of the scored halves (llama-server's greedy next token after
the prefix, prompts as token ids).

    python benchmarks/weight_quality.py -m models/turbospec-tiny-hybrid --types f16 bf16 q8_0 q4_0 q6_k q5_k q4_k \\
        --llama-quantize <llama.cpp>/build/bin/llama-quantize [--llama-server <llama.cpp>/build/bin/llama-server] \\
        --json docs/results/weight_quality_hybrid.json
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def llama_top1(binary: str, path: Path, prefixes: list[list[int]], ctx: int) -> list[int]:
    """llama-server's greedy next token after each prefix (token ids), on the GGUF file `path`."""
    import httpx
    from served_speed import free_port, server  # this folder's llama-server start-up and readiness wait

    port = free_port()
    cmd = [binary, "-m", str(path), "--port", str(port), "-c", str(ctx + 16), "-np", "1", "--no-webui", "-t", "2"]
    with server(cmd, port) as url:
        out = []
        for ids in prefixes:
            r = httpx.post(f"{url}/completion", json={"prompt": ids, "n_predict": 1, "temperature": 0, "top_k": 1,
                                                      "cache_prompt": True, "return_tokens": True}, timeout=120)
            out.append(int(r.json()["tokens"][0]))
        return out


K_QUANTS = {"q4_k": "Q4_K_M", "q5_k": "Q5_K_M", "q6_k": "Q6_K"}  # llama-quantize names; --pure: every tensor it can


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(ROOT / "models" / "turbospec-tiny-hybrid"))
    ap.add_argument("--types", nargs="+", default=["f16", "bf16", "q8_0", "q4_0"])
    ap.add_argument("--llama-quantize", default=None, help="llama.cpp's llama-quantize, for the K-quant types")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server: top-1 agreement on each file")
    ap.add_argument("--llama-positions", type=int, default=16, help="positions per chunk for --llama-server")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from turbospec.lab.quality import EVAL_DIR, chunk_logprobs, kld_stats, read_text
    from turbospec.model.gguf_export import export_gguf
    from turbospec.model.gguf_reader import GGUFContents
    from turbospec.model.registry import load_model
    from turbospec.tokenizer import Tokenizer

    tokens = Tokenizer(a.model).encode(read_text(EVAL_DIR / "prose.jsonl"), add_special=False)
    n_chunks = min(len(tokens) // a.ctx, a.chunks)
    chunks = [torch.tensor(tokens[c * a.ctx:(c + 1) * a.ctx]) for c in range(n_chunks)]
    ref_model = load_model(a.model, "float32")
    refs = [chunk_logprobs(ref_model, ids, "f32", "f32", a.ctx) for ids in chunks]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        f16 = None
        for kind in a.types:
            path = Path(tmp) / f"{kind}.gguf"
            if kind in K_QUANTS:
                if not a.llama_quantize:
                    print(f"{kind}: skipped (needs --llama-quantize)")
                    continue
                f16 = f16 or export_gguf(a.model, Path(tmp) / "f16-src.gguf", "f16")
                subprocess.run([a.llama_quantize, "--pure", str(f16), str(path), K_QUANTS[kind]], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            else:
                export_gguf(a.model, path, kind)
            r = GGUFContents(path)
            weights = sum(int(t.n_elements) for t in r.tensors)
            types = sorted({t.tensor_type.name for t in r.tensors if len(t.shape) == 2})
            model = load_model(path, "float32")
            kl, same, nll, n = [], 0, 0.0, 0
            prefixes, ours = [], []  # for llama-server: positions of the scored halves, turbospec's top-1 there
            for ids, base in zip(chunks, refs):
                lp = chunk_logprobs(model, ids, "f32", "f32", a.ctx)
                step = max(1, lp.shape[0] // a.llama_positions)
                for i in range(0, lp.shape[0], step)[:a.llama_positions]:
                    prefixes.append(ids[:a.ctx // 2 + 1 + i].tolist())
                    ours.append(int(lp[i].argmax()))
                kl.append((base.exp() * (base - lp)).sum(-1).clamp_min(0))
                same += int((lp.argmax(-1) == base.argmax(-1)).sum())
                targets = ids[a.ctx // 2 + 1:]
                nll -= lp.gather(1, targets[:, None]).sum().item()
                n += targets.numel()
            st = kld_stats(torch.cat(kl))
            row = {"type": kind, "matrix_types": types, "bits_per_weight": path.stat().st_size * 8 / weights,
                   "kld_mean": st["kld_mean"], "kld_p99": st["kld_p99"], "top1_agreement": same / n,
                   "ppl": math.exp(nll / n)}
            if a.llama_server:
                theirs = llama_top1(a.llama_server, path, prefixes, a.ctx)
                row["llama_cpp_top1_agreement"] = sum(x == y for x, y in zip(ours, theirs)) / len(ours)
                row["llama_cpp_positions"] = len(ours)
            rows.append(row)
            print(f"{kind:5s} {'/'.join(types):16s} {row['bits_per_weight']:5.2f} bpw  KLD mean {row['kld_mean']:.6f}"
                  f"  p99 {row['kld_p99']:.6f}  top-1 {row['top1_agreement']:.4f}  ppl {row['ppl']:.3f}"
                  + (f"  top-1 = llama.cpp's on the file {row['llama_cpp_top1_agreement']:.4f}"
                     f" ({row['llama_cpp_positions']} positions)" if a.llama_server else ""), flush=True)
    nll = sum(-base.gather(1, ids[a.ctx // 2 + 1:][:, None]).sum().item() for ids, base in zip(chunks, refs))
    ref_ppl = math.exp(nll / sum(ids[a.ctx // 2 + 1:].numel() for ids in chunks))
    print(f"float32 checkpoint ppl {ref_ppl:.3f} ({n_chunks} chunks of {a.ctx}, second halves scored)")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "ctx": a.ctx, "chunks": n_chunks, "ref_ppl": ref_ppl,
                                            "command": " ".join(sys.argv), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
