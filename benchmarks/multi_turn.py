"""Multi-turn chat through the server: time to first token of turns 1..T when every turn re-sends the whole
conversation, on a hybrid model (where re-using a prefix needs the recurrent state at its end, not only its KV).

C clients hold one conversation each, all at once: turn 1 sends a long first message (--first words), every later
turn sends the conversation so far (earlier messages and answers) plus a new message (--user words), and the
answer (--gen tokens, greedy) is appended. Per turn: TTFT (request sent -> first token) and the prompt tokens the
server says it computed (`timings.prompt_n`) against those it reused (`timings.cache_n`). Engines, one after the
other on the same conversations (fresh text each round, so no round finds another's prefix):

- `turbospec`: `serve -np C` (continuous batching; prefix cache with recurrent-state snapshots at block boundaries)
- `turbospec no-snapshots`: the same with `--ctx-checkpoints 0` (the hybrid's prefix cannot be resumed)
- `turbospec -np 1` (C = 1 only): the one-sequence engine (recurrent states checkpointed at prompt ends)
- `llama.cpp`: `llama-server -np C` on --gguf (its own prompt cache and context checkpoints, defaults)

    python benchmarks/multi_turn.py --gguf /tmp/hybrid-bf16.gguf --flags "--dtype bfloat16" \\
        --llama-server <llama.cpp>/build/bin/llama-server --clients 1 4 --json docs/results/multi_turn.json
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
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served_speed import free_port, server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def words(seed: int, n: int) -> str:
    """n consecutive words of the shipped prose evaluation text, from a place chosen by seed."""
    global _WORDS
    if not _WORDS:
        lines = (ROOT / "turbospec" / "data" / "eval" / "prose.jsonl").read_text().splitlines()
        _WORDS = " ".join(json.loads(x)["text"] for x in lines if x.strip()).split()
    start = random.Random(seed).randrange(len(_WORDS) - n)
    return " ".join(_WORDS[start:start + n])


_WORDS: list[str] = []


async def turn(client: httpx.AsyncClient, url: str, prompt: str, n: int) -> dict:
    body = {"prompt": prompt, "max_tokens": n, "n_predict": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "cache_prompt": True}
    t0 = time.perf_counter()
    first = None
    text, timings = [], {}
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=1200) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            d = json.loads(payload)
            timings = d.get("timings") or timings
            piece = "".join(c.get("text") or "" for c in d.get("choices") or [])
            if piece:
                first = first or time.perf_counter()
                text.append(piece)
    return {"ttft_ms": ((first or time.perf_counter()) - t0) * 1e3, "text": "".join(text),
            "prompt_n": timings.get("prompt_n"), "cache_n": timings.get("cache_n")}


async def conversation(url: str, seed: int, a) -> list[dict]:
    rows = []
    prompt = "User: " + words(seed, a.first) + "\nAssistant:"
    async with httpx.AsyncClient() as client:
        for t in range(a.turns):
            res = await turn(client, url, prompt, a.gen)
            rows.append({"turn": t + 1, "prompt_chars": len(prompt), **{k: res[k] for k in res if k != "text"}})
            prompt += res["text"] + "\nUser: " + words(seed * 1000 + t, a.user) + "\nAssistant:"
    return rows


async def clients(url: str, base_seed: int, n: int, a) -> list[list[dict]]:
    return list(await asyncio.gather(*(conversation(url, base_seed + i, a) for i in range(n))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "turbospec-tiny-hybrid"))
    ap.add_argument("--gguf", default=None, help="a GGUF file both engines load (llama-server needs one)")
    ap.add_argument("--flags", default="", help="extra turbospec serve flags, e.g. '--dtype bfloat16'")
    ap.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server")
    ap.add_argument("--llama-flags", default="", help="extra llama-server flags")
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--first", type=int, default=1200, help="words of the first message")
    ap.add_argument("--user", type=int, default=120, help="words of every later message")
    ap.add_argument("--gen", type=int, default=64, help="tokens per answer")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=8192, help="context per conversation")
    ap.add_argument("--parallel", type=int, default=None, help="turbospec -np (default: the most clients)")
    ap.add_argument("--engines", nargs="*", default=None,
                    help="run only these (names as in the tables: 'turbospec', 'turbospec -np 1', ...)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    src = a.gguf or a.model
    flags = shlex.split(a.flags)
    top = a.parallel or max(a.clients)
    ctx = top * a.ctx

    def ts(extra, np=top):
        return lambda port: ["turbospec", "serve", "-m", src, "-c", str(np * a.ctx), "-np", str(np), "-t",
                             str(a.threads), "--port", str(port), *flags, *extra]

    cmds = {"turbospec": ts([]), "turbospec no-snapshots": ts(["--ctx-checkpoints", "0"])}
    if 1 in a.clients:
        cmds["turbospec -np 1"] = ts([], 1)  # the one-sequence engine (checkpoints at prompt ends); C = 1 only
    if a.llama_server and a.gguf:
        cmds["llama.cpp"] = lambda port: [a.llama_server, "-m", a.gguf, "-c", str(ctx), "-np", str(top), "-t",
                                          str(a.threads), "-tb", str(a.threads), "--port", str(port), "-fa", "on",
                                          *shlex.split(a.llama_flags)]
    if a.engines is not None:
        unknown = set(a.engines) - set(cmds)
        if unknown:
            ap.error(f"--engines: unknown {sorted(unknown)}; choose from {sorted(cmds)}")
        cmds = {k: v for k, v in cmds.items() if k in a.engines}
    results: dict[str, dict[int, list[list[dict]]]] = {k: {c: [] for c in a.clients} for k in cmds}
    for name, cmd in cmds.items():  # one server at a time
        port = free_port()
        with server(cmd(port), port) as url:
            asyncio.run(clients(url, 999, 1, argparse.Namespace(**{**vars(a), "turns": 2, "first": 50})))  # warm-up
            for r in range(a.rounds):
                for c in ([1] if name == "turbospec -np 1" else a.clients):
                    got = asyncio.run(clients(url, 10_000 * (r + 1) + 100 * c, c, a))
                    results[name][c] += got
                    last = [conv[-1] for conv in got]
                    print(f"{name:24s} C={c} round {r}: turn 1 TTFT {statistics.median(x[0]['ttft_ms'] for x in got):7.0f}"
                          f" ms, turn {a.turns} {statistics.median(x['ttft_ms'] for x in last):7.0f} ms "
                          f"(prompt_n {last[0]['prompt_n']}, cache_n {last[0]['cache_n']})", flush=True)
    rows = []
    for name in cmds:
        for c in a.clients:
            convs = results[name][c]
            if not convs:
                continue
            for t in range(a.turns):
                per = [conv[t] for conv in convs]
                rows.append({"engine": name, "clients": c, "turn": t + 1,
                             "ttft_ms_p50": statistics.median(x["ttft_ms"] for x in per),
                             "prompt_n_p50": statistics.median(x["prompt_n"] or 0 for x in per),
                             "cache_n_p50": statistics.median(x["cache_n"] or 0 for x in per),
                             "prompt_chars": per[0]["prompt_chars"]})
    def table(width: int, cell, title: str) -> None:
        print(f"\n{'engine':24s} {'C':>2s} " + " ".join(f"{'t' + str(t + 1):>{width}s}" for t in range(a.turns))
              + f"   ({title})")
        for name in cmds:
            for c in a.clients:
                line = [r for r in rows if r["engine"] == name and r["clients"] == c]
                if line:
                    print(f"{name:24s} {c:2d} " + " ".join(cell(r) for r in line))

    table(6, lambda r: f"{r['ttft_ms_p50']:6.0f}", "TTFT p50, ms")
    table(11, lambda r: f"{r['prompt_n_p50']:5.0f}/{r['cache_n_p50']:<5.0f}", "prompt tokens computed / reused, p50")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
