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
`--spec-type draft-mtp --spec-draft-n-max N`; other drafters have no llama-server twin and skip it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            msg = json.loads(payload)
            if msg.get("usage"):
                n_tok = msg["usage"].get("completion_tokens") or n_tok
            for c in msg.get("choices", []):
                if c.get("text"):
                    stamps.append(time.perf_counter())
    n_tok = n_tok or len(stamps)
    decode = (n_tok - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return {"ttft_ms": (stamps[0] - t0) * 1e3, "decode_tps": decode, "tokens": n_tok}


class EngineProcess:
    """The engine side: one process that parses `turbospec run` flags with the command line's own parser, builds
    the engine as `turbospec run` does, warms it up, then runs `engine.stream` (what `turbospec run` calls, writing
    each chunk's text to a sink) for every prompt sent on stdin and answers with its GenStats. Kept warm like a
    server, so that neither side pays process start-up or first-call costs in its numbers."""

    def __init__(self, run_args: list[str]):
        self.proc = subprocess.Popen([sys.executable, __file__, "--engine-worker", *run_args], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def run(self, prompt: str) -> dict:
        self.proc.stdin.write(json.dumps(prompt) + "\n")
        self.proc.stdin.flush()
        st = json.loads(self.proc.stdout.readline())
        return {"ttft_ms": st["ttft_s"] * 1e3, "decode_tps": st["decode_tps"], "tokens": st["gen_tokens"]}

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
    if "--spec-type" not in flags:
        return []
    kind = flags[flags.index("--spec-type") + 1]
    if kind != "draft-mtp":
        return None
    n_max = flags[flags.index("--spec-draft-n-max") + 1] if "--spec-draft-n-max" in flags else "3"
    return ["--spec-type", "draft-mtp", "--spec-draft-n-max", n_max]


@contextlib.contextmanager
def server(cmd: list[str], port: int, env: dict | None = None):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT, env=env)
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
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:  # every configuration's processes at once: rounds interleave them all
        sides_of: dict[str, list[tuple[str, EngineProcess | str]]] = {}
        for name, flag_text in configs:
            flags = shlex.split(flag_text)
            port_ts, port_ll = free_port(), free_port()
            ts_cmd = [sys.executable, "-m", "turbospec.cli", "serve", "-m", a.model, "--port", str(port_ts),
                      "-n", str(a.n), "--temp", "0", *flags, *shlex.split(a.serve_flags)]
            ts_cmd += ["-t", str(a.threads)] if a.threads else []
            ll = llama_flags(flags) if a.llama_server and a.gguf else None
            run_args = ["-m", a.model, "-n", str(a.n), "--temp", "0", "--ignore-eos", *flags]
            run_args += ["-t", str(a.threads)] if a.threads else []
            eng = EngineProcess(run_args)
            stack.callback(eng.close)
            sides_of[name] = [("turbospec run", eng), ("turbospec serve", stack.enter_context(server(ts_cmd, port_ts)))]
            if ll is not None:
                ll_cmd = [a.llama_server, "-m", a.gguf, "--port", str(port_ll), "-c", "4096", "-np", "1",
                          "--no-webui", *ll] + (["-t", str(a.threads)] if a.threads else [])
                sides_of[name].append(("llama-server", stack.enter_context(server(ll_cmd, port_ll))))
        client = httpx.Client()
        stack.callback(client.close)
        for sides in sides_of.values():  # warm-up, discarded
            for _, target in sides[1:]:
                stream(client, str(target), prompts[0], 16)
        for rnd in range(a.rounds):
            for i, p in enumerate(prompts):
                for name, sides in sides_of.items():
                    for side, target in sides:
                        if isinstance(target, EngineProcess):
                            r = target.run(p)
                        else:  # llama-server gets token ids: the GGUF's tokenizer need not split text as ours does
                            prompt = tok.encode(p, add_special=True) if side == "llama-server" else p
                            r = stream(client, target, prompt, a.n)
                        r.update(config=name, side=side, round=rnd, prompt=i)
                        rows.append(r)
                        print(f"{name:8s} {side:16s} round {rnd} prompt {i}: decode {r['decode_tps']:7.1f} t/s, "
                              f"ttft {r['ttft_ms']:6.1f} ms ({r['tokens']} tok)", flush=True)
                        time.sleep(0.05)  # the last process's idle threads stop spinning before the next one runs
    summary = []
    first = configs[0][0]
    print(f"\n| config | side | decode t/s (median) | vs run | vs llama-server | vs llama-server {first} | "
          "TTFT ms (median) | TTFT - run (ms) |")
    print("|---|---|---|---|---|---|---|---|")

    def paired(sel: list[dict], base: list[dict]) -> float:
        """The median over (round, prompt) pairs measured back to back of sel's decode t/s over base's."""
        ratios = [s["decode_tps"] / b["decode_tps"] for s in sel for b in base
                  if (s["round"], s["prompt"]) == (b["round"], b["prompt"]) and b["decode_tps"] > 0]
        return statistics.median(ratios) if ratios else float("nan")

    for name, _ in configs:
        base = [r for r in rows if r["config"] == name and r["side"] == "turbospec run"]
        llama = [r for r in rows if r["config"] == name and r["side"] == "llama-server"]
        llama_first = [r for r in rows if r["config"] == first and r["side"] == "llama-server"]
        for side in ("turbospec run", "turbospec serve", "llama-server"):
            sel = [r for r in rows if r["config"] == name and r["side"] == side]
            if not sel:
                continue
            ratio, vs_llama, vs_first = paired(sel, base), paired(sel, llama), paired(sel, llama_first)
            dttft = statistics.median(
                s["ttft_ms"] - b["ttft_ms"] for s in sel for b in base
                if (s["round"], s["prompt"]) == (b["round"], b["prompt"]))
            row = {"config": name, "side": side, "decode_tps": med(sel, "decode_tps"), "ratio_vs_run": ratio,
                   "ratio_vs_llama_server": vs_llama,
                   f"ratio_vs_llama_server_{first}": vs_first, "ttft_ms": med(sel, "ttft_ms"), "ttft_minus_run_ms": dttft, "n": len(sel)}
            summary.append(row)
            print(f"| {name} | {side} | {row['decode_tps']:.1f} | {ratio:.2f}x | {vs_llama:.2f}x | {vs_first:.2f}x | {row['ttft_ms']:.1f} | "
                  f"{dttft:+.1f} |")
    if a.json:
        meta = {"model": a.model, "n": a.n, "rounds": a.rounds, "categories": a.categories, "threads": a.threads,
                "configs": dict(configs), "serve_flags": a.serve_flags, "llama_server": a.llama_server, "gguf": a.gguf,
                "cpu_count": os.cpu_count(), "command": " ".join(shlex.quote(x) for x in sys.argv)}
        Path(a.json).write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
