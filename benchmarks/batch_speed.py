"""Continuous batching through the server: aggregate decode throughput, TTFT and per-stream speed at 1, 4, 8, 16 and
32 concurrent streams, turbospec (`serve -np`) side by side with llama-server (`-np`, continuous batching) on the same
weights, in interleaved rounds.

Each load sends S streamed greedy completions at once (distinct random token-id prompts of --prompt tokens,
--gen tokens each, `ignore_eos`); aggregate t/s = all completion tokens / (last token received - first request
sent), prefill included; per stream: TTFT (request sent -> first token) and decode t/s ((tokens - 1) / (last -
first token)), and their sum (aggregate decode speed while the streams decode together). The
single-stream reference is `turbospec serve` with -np 1 (the one-sequence engine) at S = 1. Servers run one at a
time between loads only in the sense of load: they all stay up (idle servers cost nothing), and the loads of one
round alternate between them.

    python benchmarks/batch_speed.py --model models/demo-qwen3 --flags "--dtype bfloat16" \\
        --llama-server <llama.cpp>/build/bin/llama-server --gguf models/demo-qwen3/bench-f16.gguf \\
        --rounds 3 --json docs/results/batch_speed.json

Without --gguf, turbospec loads --model (HF safetensors) and llama-server is skipped; its tokenizer must name
every row the model can sample (models/demo-qwen3's names 259 of 32000: use its GGUF export), else the text
arrives in one piece and the load is refused. With --gguf, both engines
load that file (turbospec with --flags on top: e.g. --dtype bfloat16 computes in bf16 from the f16 file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_steps import add_load_args  # noqa: E402
from multi_turn import words as prose  # noqa: E402
from served_speed import free_port, server  # noqa: E402


async def one(client: httpx.AsyncClient, url: str, prompt: list[int] | str, n: int) -> dict:
    body = {"prompt": prompt, "max_tokens": n, "n_predict": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = pieces = 0
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=1200) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            now = time.perf_counter()
            if '"usage"' in payload and '"completion_tokens"' in payload:
                usage = json.loads(payload).get("usage") or {}
                tokens = usage.get("completion_tokens", tokens)
            if '"text": ""' in payload or '"text":""' in payload:
                continue
            first = first or now
            last = now
            pieces += 1
    if tokens > 2 and pieces <= 2:  # the text came at the end, not token by token: TTFT and stream speeds would lie
        raise RuntimeError(f"{tokens} tokens arrived as {pieces} pieces of text: this model's tokenizer decodes its "
                           "tokens to nothing (models/demo-qwen3's has 259 tokens for 32000 rows); serve a GGUF export "
                           "of it (--gguf, as benchmarks/to_gguf.py writes), whose vocabulary names every row")
    return {"t0": t0, "ttft_ms": ((first or t0) - t0) * 1e3, "first": first, "last": last, "tokens": tokens,
            "decode_tps": (tokens - 1) / (last - first) if first and last and last > first else 0.0}


async def load(url: str, prompts: list, n: int) -> dict:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(prompts) + 4)) as client:
        rows = await asyncio.gather(*(one(client, url, p, n) for p in prompts))
    start = min(r["t0"] for r in rows)
    end = max(r["last"] or r["t0"] for r in rows)
    total = sum(r["tokens"] for r in rows)
    if any(r["tokens"] != n for r in rows):
        raise RuntimeError(f"a stream returned {[r['tokens'] for r in rows]} tokens, expected {n} each")
    ttft = sorted(r["ttft_ms"] for r in rows)
    dec = sorted(r["decode_tps"] for r in rows)
    return {"aggregate_tps": total / (end - start), "decode_tps_sum": sum(dec), "ttft_p50_ms": statistics.median(ttft),
            "ttft_p90_ms": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "stream_tps_p50": statistics.median(dec), "stream_tps_p10": dec[int(0.1 * len(dec))]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/demo-qwen3", help="HF checkpoint (built by turbospec.demo if absent)")
    ap.add_argument("--gguf", default=None, help="a GGUF file both engines load (llama-server needs one)")
    ap.add_argument("--flags", default="", help="extra turbospec serve flags, e.g. '--dtype bfloat16'")
    ap.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server")
    add_load_args(ap)
    ap.add_argument("--load-timeout", type=float, default=300.0, help="seconds before a load counts as stuck")
    ap.add_argument("--text", action="store_true", help="prompts: slices of the shipped prose text (default: random "
                    "token ids), so that drafts can hit")
    ap.add_argument("--spec", default=None, help="also serve turbospec with these flags ('turbospec spec'), e.g. "
                    "'--spec-type draft-mtp'")
    a = ap.parse_args()
    path = Path(a.model)
    if not (path / "config.json").exists():
        from turbospec.demo import make_demo_model

        make_demo_model(path)
    src = a.gguf or str(path)
    top = max(a.streams)
    per = (2 if a.text else 1) * a.prompt + a.gen + 16  # (a prose word is 1-2 tokens)
    ctx = top * per
    flags = shlex.split(a.flags)
    cmds = {
        "turbospec -np 1": lambda port: ["turbospec", "serve", "-m", src, "-c", str(per),
                                         "-t", str(a.threads), "--port", str(port), *flags],
        "turbospec": lambda port: ["turbospec", "serve", "-m", src, "-c", str(ctx), "-np", str(top),
                                   "--max-queue", str(4 * top), "-t", str(a.threads), "--port", str(port), *flags],
    }
    if a.spec:
        cmds["turbospec spec"] = lambda port: [*cmds["turbospec"](port), *shlex.split(a.spec)]
    if a.llama_server and a.gguf:
        cmds["llama.cpp"] = lambda port: [a.llama_server, "-m", a.gguf, "-c", str(ctx), "-np", str(top), "-t",
                                          str(a.threads), "-tb", str(a.threads), "--port", str(port), "-fa", "on",
                                          "-ub", "512", "-b", "2048"]
    rnd = random.Random(0)
    vocab = json.loads((path / "config.json").read_text()).get("vocab_size", 32000)
    results: dict[str, dict[int, list[dict]]] = {k: {s: [] for s in a.streams} for k in cmds}
    servers: dict[str, tuple[ExitStack, str]] = {}
    restarts = dict.fromkeys(cmds, 0)

    def start(name: str) -> None:
        stack = ExitStack()
        port = free_port()
        servers[name] = (stack, stack.enter_context(server(cmds[name](port), port)))

    def run_load(name: str, prompts: list) -> dict:
        """One load; a server that does not finish it in --load-timeout seconds is restarted and the load repeated
        (llama-server 0.3.36 has been seen to stop answering after a few hundred requests)."""
        for _ in range(3):
            try:
                return asyncio.run(asyncio.wait_for(load(servers[name][1], prompts, a.gen), a.load_timeout))
            except (asyncio.TimeoutError, httpx.HTTPError) as e:
                print(f"{name}: load not finished ({type(e).__name__}); restarting the server", flush=True)
                servers[name][0].close()
                start(name)
                restarts[name] += 1
        raise RuntimeError(f"{name} failed the same load three times")

    try:
        for name in cmds:
            start(name)
        for r in range(a.rounds + 1):  # round 0 warms up
            for s in a.streams:
                for name in cmds:
                    if name == "turbospec -np 1" and s != 1:
                        continue
                    prompts = ([prose(rnd.randrange(10**9), a.prompt) for _ in range(s)] if a.text else
                               [[rnd.randrange(3, vocab) for _ in range(a.prompt)] for _ in range(s)])
                    res = run_load(name, prompts)
                    if r:
                        results[name][s].append(res)
                    print(f"round {r} S={s:2d} {name:16s} {res['aggregate_tps']:8.1f} t/s aggregate, "
                          f"ttft p50 {res['ttft_p50_ms']:.0f} ms, stream p50 {res['stream_tps_p50']:.1f} t/s",
                          flush=True)
    finally:
        for stack, _ in servers.values():
            stack.close()
    rows = []
    base = statistics.median(x["aggregate_tps"] for x in results["turbospec -np 1"][1]) if 1 in a.streams else None
    for name in cmds:
        for s in a.streams:
            got = results[name][s]
            if not got:
                continue
            row = {"engine": name, "streams": s, **{k: statistics.median(x[k] for x in got) for k in got[0]}}
            if base:
                row["vs_single_stream"] = row["aggregate_tps"] / base
            rows.append(row)
    by = {(r["engine"], r["streams"]): r for r in rows}
    for r in rows:
        ll = by.get(("llama.cpp", r["streams"]))
        if ll and r["engine"] == "turbospec":
            r["vs_llama_cpp"] = r["aggregate_tps"] / ll["aggregate_tps"]
    print(f"\n{'engine':18s} {'S':>3s} {'agg t/s':>9s} {'x single':>8s} {'x llama':>8s} {'decode sum':>10s} "
          f"{'ttft p50':>9s} {'ttft p90':>9s} {'stream p50':>10s} {'p10':>7s}")
    for r in rows:
        print(f"{r['engine']:18s} {r['streams']:3d} {r['aggregate_tps']:9.1f} {r.get('vs_single_stream', 0):8.2f} "
              f"{r.get('vs_llama_cpp', 0):8.2f} {r['decode_tps_sum']:10.1f} {r['ttft_p50_ms']:9.0f} "
              f"{r['ttft_p90_ms']:9.0f} {r['stream_tps_p50']:10.1f} {r['stream_tps_p10']:7.1f}")
    if a.json:
        out = {"command": " ".join(["python", "benchmarks/batch_speed.py", *sys.argv[1:]]), "rounds": a.rounds,
               "prompt_tokens": a.prompt, "gen_tokens": a.gen, "server_restarts": restarts, "rows": rows}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
