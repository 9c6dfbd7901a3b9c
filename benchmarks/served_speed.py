"""Served speed against engine speed: the same model, prompts and settings through `turbospec run` (the engine, no
HTTP), `turbospec serve` (streamed over HTTP) and, when given, llama-server on a GGUF converted from the same
checkpoint. Greedy, `ignore_eos`, a fixed number of tokens. Every configuration's three sides run at once and each
round runs every side of every configuration back to back, so that machine noise hits them alike; the table gives
medians of decode t/s (tokens after the first over the time after the first) and TTFT, and ratios paired within a
round: against the engine of the same configuration, against llama-server in the same configuration, and against
llama-server in the first configuration (plain decoding, when it comes first).

Served numbers are measured by a streaming client: TTFT = request sent -> first token received; decode t/s =
(tokens - 1) / (last token received - first token received). The "turbospec run" side is the engine as
`turbospec run` drives it (its flag parser, `build_engine`, `engine.stream`), kept warm in one process and fed the
prompts over a pipe; it reports its own GenStats: TTFT = prefill start -> first token, decode t/s as above.

    python benchmarks/served_speed.py -m models/turbospec-tiny-hybrid -n 128 --rounds 3 \\
        --config plain= --config "mtp=--spec-type draft-mtp --spec-draft-n-max 3" \\
        --llama-server <llama.cpp>/build/bin/llama-server --gguf tiny-hybrid-f32.gguf --json docs/results/served_speed.json

A `--config NAME=FLAGS` gives turbospec flags; the llama-server flags for it are derived (draft-mtp ->
`--spec-type draft-mtp --spec-draft-n-max N`, `-ctk/-ctv` f16 / q8_0 / q4_0 as they are; other drafters,
`--spec-adaptive` and KV types llama.cpp lacks have no llama-server twin and skip it).

At depth (`--depth D`): every request starts with the same D random token ids (seeded, as `turbospec bench -d`),
then 16 random ids that differ per round and the prompt, all sent as token ids to every side, each side's context
`-c D + 1024`. Each side reads the D-token context once (a warm-up request, untimed) and every measured request
resumes there from its prompt cache (a hybrid from the recurrent-state checkpoint that warm-up left before the
context's last token); `prompt_n` / `cache_n` in the rows say what each side computed, so the prompt after the
context is timed with and without MTP (`prompt_tps`, from the response's llama-server-style `timings`, as is
the acceptance `draft_n_accepted / draft_n`). llama.cpp's own MTP drafting runs only in llama-server: this is the
run that puts it beside turbospec's at depth.

    python benchmarks/served_speed.py -m models/turbospec-tiny-hybrid --depth 32768 -n 64 --rounds 3 \
        --categories code --sides serve,llama --config "plain=--dtype float16" \
        --config "mtp=--dtype float16 --spec-type draft-mtp --spec-draft-n-max 3" \
        --config "tbq4-adaptive=--dtype float16 -ctk tbq4_0 -ctv tbq4_0 --spec-type draft-mtp --spec-adaptive" \
        --llama-server <llama.cpp>/build/bin/llama-server --gguf hyb-f16.gguf --json docs/results/served_depth_32k.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    t_end = time.time() + timeout
    while time.time() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise RuntimeError("server did not become ready")


def stream(client: httpx.Client, url: str, prompt: str | list[int], n: int) -> dict:
    """One streamed greedy completion: TTFT and decode t/s as the client sees them."""
    body = {"prompt": prompt, "max_tokens": n, "n_predict": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    n_tok = 0
    timings: dict = {}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            msg = json.loads(payload)
            timings = msg.get("timings") or timings
            if msg.get("usage"):
                n_tok = msg["usage"].get("completion_tokens") or n_tok
            for c in msg.get("choices", []):
                if c.get("text"):
                    stamps.append(time.perf_counter())
    n_tok = n_tok or len(stamps)
    decode = (n_tok - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return {"ttft_ms": (stamps[0] - t0) * 1e3, "decode_tps": decode, "tokens": n_tok, **from_timings(timings)}


def from_timings(t: dict) -> dict:
    """What a response's llama-server-style `timings` tell: prompt positions computed and reused, the rate of
    those computed, drafted and accepted tokens (absent keys: None)."""
    return {"prompt_n": t.get("prompt_n"), "cache_n": t.get("cache_n"), "prompt_tps": t.get("prompt_per_second"),
            "draft_n": t.get("draft_n"), "draft_n_accepted": t.get("draft_n_accepted")}


class EngineProcess:
    """The engine side: one process that parses `turbospec run` flags with the command line's own parser, builds
    the engine as `turbospec run` does, warms it up, then runs `engine.stream` (what `turbospec run` calls, writing
    each chunk's text to a sink) for every prompt sent on stdin and answers with its GenStats. Kept warm like a
    server, so that neither side pays process start-up or first-call costs in its numbers."""

    def __init__(self, run_args: list[str]):
        self.proc = subprocess.Popen([sys.executable, __file__, "--engine-worker", *run_args], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def run(self, prompt: str | list[int]) -> dict:
        self.proc.stdin.write(json.dumps(prompt) + "\n")
        self.proc.stdin.flush()
        st = json.loads(self.proc.stdout.readline())
        spec = st.get("spec") or {}
        return {"ttft_ms": st["ttft_s"] * 1e3, "decode_tps": st["decode_tps"], "tokens": st["gen_tokens"],
                "prompt_n": st["prompt_tokens"] - st["cached_tokens"], "cache_n": st["cached_tokens"],
                "prompt_tps": st["prefill_tps"], "draft_n": spec.get("draft_tokens"),
                "draft_n_accepted": spec.get("accepted")}

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def engine_worker(run_args: list[str]) -> None:
    from turbospec.cli.args import engine_config, sampling_params
    from turbospec.cli.main import build_parser
    from turbospec.engine import build_engine

    a = build_parser().parse_args(["run", *run_args])
    engine, params = build_engine(engine_config(a)), sampling_params(a)
    sink = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    for _ in range(2):
        for c in engine.stream("warm up", params):
            sink.write(c.text)
    print("ready", flush=True)
    for line in sys.stdin:
        for c in engine.stream(json.loads(line), params):
            sink.write(c.text)
            sink.flush()
        print(json.dumps(engine.last_stats.to_dict()), flush=True)


def llama_flags(flags: list[str]) -> list[str] | None:
    """llama-server's flags for a turbospec configuration; None when it has no twin there."""
    out = []
    for flag in ("-ctk", "-ctv"):
        if flag in flags:
            kv = flags[flags.index(flag) + 1]
            if kv not in ("f16", "q8_0", "q4_0"):
                return None
            out += [flag, kv]
    if "--spec-adaptive" in flags:
        return None
    if "--spec-type" not in flags:
        return out
    kind = flags[flags.index("--spec-type") + 1]
    if kind != "draft-mtp":
        return None
    n_max = flags[flags.index("--spec-draft-n-max") + 1] if "--spec-draft-n-max" in flags else "3"
    return [*out, "--spec-type", "draft-mtp", "--spec-draft-n-max", n_max]


@contextlib.contextmanager
def server(cmd: list[str], port: int, env: dict | None = None, procs: list | None = None):
    """The server `cmd` runs, its URL once it answers /health; stopped on exit. `procs` gets its Popen."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    if procs is not None:
        procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows) if rows else float("nan")


def main() -> int:
    if sys.argv[1:2] == ["--engine-worker"]:
        sys.path.insert(0, str(ROOT))
        engine_worker(sys.argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(ROOT / "models" / "turbospec-tiny-hybrid"))
    ap.add_argument("-n", type=int, default=128, help="tokens per completion (default 128)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--categories", default="code,explain", help="shipped prompt categories (default code,explain)")
    ap.add_argument("--config", action="append", default=[], help="NAME=TURBOSPEC FLAGS (repeatable)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="threads for every side (default: each one's own)")
    ap.add_argument("--llama-server", default=None, help="path of llama-server (optional)")
    ap.add_argument("--gguf", default=None, help="the same checkpoint as GGUF, for llama-server")
    ap.add_argument("--serve-flags", default="", help="extra flags for turbospec serve only")
    ap.add_argument("--depth", type=int, default=0, help="random tokens of context before every prompt (default 0)")
    ap.add_argument("--sides", default="run,serve,llama", help="which of run, serve, llama to measure (default all)")
    ap.add_argument("--llama-for", default=None,
                    help="comma list of the configurations that get a llama-server twin (default: all that have one)")
    ap.add_argument("--json", default=None, help="write rows and medians here")
    a = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    from turbospec.lab.workload import load_prompts
    from turbospec.tokenizer import Tokenizer

    prompts = list(load_prompts(a.categories).values())
    if a.model.endswith(".gguf"):  # the tokenizer from the file's metadata
        from turbospec.model.gguf import GGUFFile

        tok = Tokenizer.from_gguf(GGUFFile(a.model).meta)
    else:
        tok = Tokenizer(a.model)
    configs = [c.split("=", 1) for c in (a.config or ["plain="])]
    sides_wanted = set(a.sides.split(","))
    ids = [tok.encode(p, add_special=True) for p in prompts]  # llama-server always gets token ids: the GGUF's
    # tokenizer need not split text as ours does
    filler: list[int] = []
    ctx: list[str] = []
    if a.depth:  # a context of random ids, then per round 16 more and the prompt (see the module's doc)
        vocab = tok.vocab_size
        rng = random.Random(1234 + a.depth)
        filler = [rng.randrange(3, vocab) for _ in range(a.depth)]
        ctx = ["-c", str(a.depth + 1024)]

    llama_ctx: list[str] = []
    if a.depth and a.gguf:  # llama-server caps a slot at the trained context unless the file says more
        from turbospec.model.gguf import GGUFFile

        arch = GGUFFile(a.gguf).meta["general.architecture"]
        llama_ctx = ["--override-kv", f"{arch}.context_length=int:{a.depth + 1024}"]

    def request(rnd: int, i: int, side: str) -> str | list[int]:
        """What `side` is sent: at depth the same token ids for every side, else text (token ids to llama-server)."""
        if not a.depth:
            return ids[i] if side == "llama-server" else prompts[i]
        r = random.Random(rnd)
        return filler + [r.randrange(3, tok.vocab_size) for _ in range(16)] + ids[i]
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:  # every configuration's processes at once: rounds interleave them all
        sides_of: dict[str, list[tuple[str, EngineProcess | str]]] = {}
        for name, flag_text in configs:
            flags = shlex.split(flag_text)
            port_ts, port_ll = free_port(), free_port()
            ts_cmd = [sys.executable, "-m", "turbospec.cli", "serve", "-m", a.model, "--port", str(port_ts),
                      "-n", str(a.n), "--temp", "0", *ctx, *flags, *shlex.split(a.serve_flags)]
            ts_cmd += ["-t", str(a.threads)] if a.threads else []
            ll = llama_flags(flags) if a.llama_server and a.gguf and "llama" in sides_wanted else None
            ll = ll if a.llama_for is None or name in a.llama_for.split(",") else None
            run_args = ["-m", a.model, "-n", str(a.n), "--temp", "0", "--ignore-eos", *ctx, *flags]
            run_args += ["-t", str(a.threads)] if a.threads else []
            sides_of[name] = []
            if "run" in sides_wanted:
                eng = EngineProcess(run_args)
                stack.callback(eng.close)
                sides_of[name].append(("turbospec run", eng))
            if "serve" in sides_wanted:
                sides_of[name].append(("turbospec serve", stack.enter_context(server(ts_cmd, port_ts))))
            if ll is not None:
                ll_cmd = [a.llama_server, "-m", a.gguf, "--port", str(port_ll), "-c", str(max(4096, a.depth + 1024)),
                          "-np", "1", "--no-webui", *ll, *llama_ctx] + (["-t", str(a.threads)] if a.threads else [])
                sides_of[name].append(("llama-server", stack.enter_context(server(ll_cmd, port_ll))))
        client = httpx.Client()
        stack.callback(client.close)
        warm: list[dict] = []
        for name, sides in sides_of.items():  # warm-up, untimed (at depth: each side reads the context once)
            for side, target in sides:
                t0 = time.perf_counter()
                if isinstance(target, EngineProcess):
                    if a.depth:
                        target.run(filler)
                    continue
                if a.depth:  # start-up costs (first calls, adaptive calibration) first, then the context alone
                    stream(client, str(target), ids[0], 16)
                    t0 = time.perf_counter()
                r = stream(client, str(target), filler if a.depth else prompts[0], 1 if a.depth else 16)
                if a.depth:
                    warm.append({"config": name, "side": side, "s": time.perf_counter() - t0, **r})
                    print(f"{name:8s} {side:16s} read the {a.depth}-token context in {warm[-1]['s']:.1f} s",
                          flush=True)
        for rnd in range(a.rounds):
            for i in range(len(prompts)):
                for name, sides in sides_of.items():
                    for side, target in sides:
                        if isinstance(target, EngineProcess):
                            r = target.run(request(rnd, i, side))
                        else:
                            r = stream(client, target, request(rnd, i, side), a.n)
                        r.update(config=name, side=side, round=rnd, prompt=i)
                        rows.append(r)
                        acc = (f", acc {r['draft_n_accepted'] / r['draft_n']:.2f}" if r.get("draft_n") else "")
                        pp = (f", prompt {r['prompt_n']} tok at {r['prompt_tps']:.0f} t/s ({r['cache_n']} cached)"
                              if r.get("prompt_tps") else "")
                        print(f"{name:8s} {side:16s} round {rnd} prompt {i}: decode {r['decode_tps']:7.1f} t/s, "
                              f"ttft {r['ttft_ms']:6.1f} ms ({r['tokens']} tok){acc}{pp}", flush=True)
                        time.sleep(0.05)  # the last process's idle threads stop spinning before the next one runs
    summary = []
    first = configs[0][0]
    print(f"\n| config | side | decode t/s (median) | vs run | vs llama-server | vs llama-server {first} | "
          f"vs {first} (same side) | acceptance | prompt t/s (median) | TTFT ms (median) | TTFT - run (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def paired(sel: list[dict], base: list[dict]) -> float:
        """The median over (round, prompt) pairs measured back to back of sel's decode t/s over base's."""
        ratios = [s["decode_tps"] / b["decode_tps"] for s in sel for b in base
                  if (s["round"], s["prompt"]) == (b["round"], b["prompt"]) and b["decode_tps"] > 0]
        return statistics.median(ratios) if ratios else float("nan")

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for name, _ in configs:
        base = [r for r in rows if r["config"] == name and r["side"] == "turbospec run"]
        llama = [r for r in rows if r["config"] == name and r["side"] == "llama-server"]
        llama_first = [r for r in rows if r["config"] == first and r["side"] == "llama-server"]
        for side in ("turbospec run", "turbospec serve", "llama-server"):
            sel = [r for r in rows if r["config"] == name and r["side"] == side]
            if not sel:
                continue
            same_first = [r for r in rows if r["config"] == first and r["side"] == side]
            ratio, vs_llama, vs_first = paired(sel, base), paired(sel, llama), paired(sel, llama_first)
            dttfts = [s["ttft_ms"] - b["ttft_ms"] for s in sel for b in base
                      if (s["round"], s["prompt"]) == (b["round"], b["prompt"])]
            dttft = statistics.median(dttfts) if dttfts else float("nan")
            drafted = sum(r.get("draft_n") or 0 for r in sel)
            prompt_rates = [r["prompt_tps"] for r in sel if r.get("prompt_tps")]
            row = {"config": name, "side": side, "decode_tps": med(sel, "decode_tps"), "ratio_vs_run": ratio,
                   "ratio_vs_llama_server": vs_llama, f"ratio_vs_llama_server_{first}": vs_first,
                   f"ratio_vs_{first}_same_side": paired(sel, same_first),
                   "acceptance": sum(r.get("draft_n_accepted") or 0 for r in sel) / drafted if drafted else None,
                   "prompt_tps": statistics.median(prompt_rates) if prompt_rates else None,
                   "ttft_ms": med(sel, "ttft_ms"), "ttft_minus_run_ms": dttft, "n": len(sel)}
            summary.append(row)
            print(f"| {name} | {side} | {row['decode_tps']:.1f} | {ratio:.2f}x | {vs_llama:.2f}x | {vs_first:.2f}x | "
                  f"{row[f'ratio_vs_{first}_same_side']:.2f}x | {fmt(row['acceptance'], '.2f')} | "
                  f"{fmt(row['prompt_tps'], '.0f')} | {row['ttft_ms']:.1f} | {dttft:+.1f} |")
    if a.json:
        meta = {"model": a.model, "n": a.n, "rounds": a.rounds, "categories": a.categories, "threads": a.threads,
                "configs": dict(configs), "serve_flags": a.serve_flags, "llama_server": a.llama_server, "gguf": a.gguf,
                "cpu_count": os.cpu_count(), "depth": a.depth, "sides": a.sides,
                "command": " ".join(shlex.quote(x) for x in sys.argv)}
        Path(a.json).write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows, "warm_up": warm},
                                           indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
