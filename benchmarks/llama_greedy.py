"""Greedy tokens of turbospec against llama.cpp's on the same GGUF file: for every shipped prompt
(turbospec/data/prompts.json, as token ids), llama-server's `/completion` at temperature 0 and turbospec's
engine (plain decoding, and `--spec-type draft-mtp` when the file has an MTP layer), each token after the prompt
compared; the first position where they differ is reported per prompt. Near-ties can go either way (the two
engines sum in different orders and keep different intermediate precisions), so a divergence is a signal to look
at, not by itself a fault.

    python benchmarks/llama_greedy.py -m hyb-q5_k_m.gguf --llama-server <llama.cpp>/build/bin/llama-server \\
        [-n 48] [--json docs/results/llama_greedy_q5_k_m.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True, help="a GGUF file")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("-n", type=int, default=48, help="greedy tokens per prompt")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from served_speed import free_port, server  # this folder's llama-server start-up and readiness wait

    from turbospec.config import EngineConfig, SpecConfig
    from turbospec.engine import Engine
    from turbospec.model import load_model
    from turbospec.model.gguf import GGUFFile
    from turbospec.sampling import SamplingParams
    from turbospec.speculative import make_drafter
    from turbospec.tokenizer import Tokenizer

    prompts = json.loads((ROOT / "turbospec/data/prompts.json").read_text())["prompts"]
    tok = Tokenizer.from_gguf(GGUFFile(a.model).meta)
    model = load_model(a.model, "float32")
    modes = ["plain"] + (["draft-mtp"] if getattr(model, "mtp", None) is not None else [])
    params = SamplingParams(max_tokens=a.n, temperature=0.0, ignore_eos=True)
    rows = []
    port = free_port()
    cmd = [a.llama_server, "-m", a.model, "--port", str(port), "-c", "4096", "-np", "1", "--no-webui",
           "-t", "2"]
    with server(cmd, port) as url:
        for cat, text in prompts.items():
            ids = tok.encode(text)
            body = {"prompt": ids, "n_predict": a.n, "temperature": 0, "top_k": 1, "return_tokens": True,
                    "cache_prompt": False}
            theirs = httpx.post(f"{url}/completion", json=body, timeout=600).json()["tokens"]
            for mode in modes:
                sc = SpecConfig(types=(mode,), n_max=3) if mode != "plain" else SpecConfig()
                drafter = make_drafter(sc, model, 4096, a.model) if mode != "plain" else None
                eng = Engine(model, tok, EngineConfig(ctx=4096, spec=sc, prefix_cache=False), drafter=drafter)
                ours = [t for ch in eng.stream(ids, params) for t in ch.tokens]
                ours = ours[:len(theirs)]  # (llama.cpp stops at an end-of-generation token)
                same = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), len(theirs))
                rows.append({"prompt": cat, "mode": mode, "compared": len(theirs), "equal_prefix": same})
                print(f"{cat:18s} {mode:9s} {same:3d} of {len(theirs)} tokens equal llama-server's", flush=True)
    whole = sum(r["equal_prefix"] == r["compared"] for r in rows)
    print(f"{whole} of {len(rows)} generations equal llama-server's throughout")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": Path(a.model).name, "n": a.n, "command": " ".join(sys.argv),
                                            "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
