"""Load test for `turbospec serve`: N concurrent streaming clients for T seconds on a loopback server.

Each client loops: POST /v1/completions (or chat) with stream=true, read the SSE stream to `data: [DONE]`,
record TTFT (send -> first text chunk), ITL (gaps between text chunks), TPOT ((e2e - TTFT) / (tokens - 1)),
end-to-end latency and the token count from `usage`; then starts the next request until T is over (requests
already started are finished). A failure is any non-200 answer, an error event, a stream without [DONE],
or a transport error. The server's RSS is sampled once a second (psutil) to check that memory stays flat.

Misbehaving clients: `--disconnect-frac F` makes that share of requests hang up mid-stream (after a random number
of events, or before the first); `--malformed-frac F` sends that share as bad requests (broken JSON, wrong types,
unknown fields, huge numbers, lone surrogates, a wrong content type), each of which must get a 4xx. Any 5xx is a
failure. After the run the script waits for `/health` to show nothing running or waiting: a job still there after
`--settle` seconds is "stuck".

Against a running server (give --server-pid for the RSS samples):

    python benchmarks/load.py --url http://127.0.0.1:8080 --clients 32 --duration 60 --server-pid PID

Or let the script start a server on a free loopback port with a tiny random demo model:

    nice -n 5 python benchmarks/load.py --spawn-tiny --clients 32 --duration 60 --json runs/load.json
    python benchmarks/load.py --spawn-tiny --clients 64 --duration 60 --disconnect-frac 0.1 --malformed-frac 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

PROMPTS = [
    "def fibonacci(n):\n",
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "SELECT name, count(*) FROM users",
    "import numpy as np\nx = np.",
    "Dear customer, thank you for",
    "1, 2, 3, 4, 5, 6,",
    "The capital of France is",
]
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300}


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(xs: list[float], scale: float = 1e3) -> dict:
    """Percentiles in ms (scale 1e3) or raw units (scale 1)."""
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": statistics.fmean(xs) * scale, "p50": pct(xs, 50) * scale,
            "p90": pct(xs, 90) * scale, "p99": pct(xs, 99) * scale, "max": max(xs) * scale}


MALFORMED = [  # (content type, body): each must be answered with a 4xx
    ("application/json", b'{"prompt": "x", "max_tokens": '),
    ("application/json", b'{"prompt": 5}'),
    ("application/json", b'{"prompt": "x", "temperature": "hot"}'),
    ("application/json", b'{"prompt": "x", "frobnicate": true}'),
    ("application/json", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"),
    ("application/json", b'{"prompt": "\\ud800"}'),  # a lone surrogate escape
    ("application/json", b'{"prompt": "x", "stop": ["' + b"s" * 1000 + b'"]}'),
    ("application/json", b"[1, 2, 3]"),
    ("application/json", b'{"prompt": "x", "logit_bias": {"-4": 1}}'),
    ("text/plain", b'{"prompt": "x"}'),
]


class Results:
    def __init__(self):
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tpot: list[float] = []
        self.e2e: list[float] = []
        self.tokens = 0
        self.ok = 0
        self.disconnected = 0  # requests that hung up on purpose
        self.rejected = 0  # malformed requests answered with a 4xx, as they must be
        self.status_5xx = 0
        self.failures: dict[str, int] = {}

    def fail(self, why: str) -> None:
        self.failures[why] = self.failures.get(why, 0) + 1


async def malformed_request(http: httpx.AsyncClient, res: Results, rng: random.Random) -> None:
    ctype, data = rng.choice(MALFORMED)
    try:
        r = await http.post("/v1/completions", content=data, headers={"Content-Type": ctype})
    except httpx.HTTPError as e:
        res.fail(f"malformed: {type(e).__name__}")
        return
    try:
        shaped = "error" in r.json()  # OpenAI-shaped error body
    except ValueError:
        shaped = False
    if 400 <= r.status_code < 500 and shaped:
        res.rejected += 1
    else:
        res.status_5xx += r.status_code >= 500
        res.fail(f"malformed answered {r.status_code}")


async def one_request(http: httpx.AsyncClient, args, res: Results, rng: random.Random) -> None:
    if rng.random() < args.malformed_frac:
        await malformed_request(http, res, rng)
        return
    hang_up_after = rng.randrange(0, 8) if rng.random() < args.disconnect_frac else None
    prompt = rng.choice(PROMPTS)
    body = {"model": args.model, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "seed": rng.randrange(1 << 30)}
    if args.chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    t0 = time.perf_counter()
    t_first = t_last = None
    itl: list[float] = []
    n_tok = None
    done = False
    try:
        async with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                res.status_5xx += r.status_code >= 500
                res.fail(f"http {r.status_code}")
                return
            events = 0
            async for line in r.aiter_lines():
                if hang_up_after is not None and events >= hang_up_after:
                    res.disconnected += 1
                    return  # leaving the block closes the connection mid-stream
                if not line.startswith("data: "):
                    continue
                events += 1
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.fail(f"error event: {msg['error'].get('type')}")
                    return
                if msg.get("usage"):
                    n_tok = msg["usage"]["completion_tokens"]
                for ch in msg.get("choices", []):
                    piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if t_first is None:
                            t_first = now
                        else:
                            itl.append(now - t_last)
                        t_last = now
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.fail(type(e).__name__)
        return
    if not done:
        res.fail("no [DONE]")
        return
    end = time.perf_counter()
    res.ok += 1
    res.e2e.append(end - t0)
    res.itl += itl
    if t_first is not None:
        res.ttft.append(t_first - t0)
    if n_tok:
        res.tokens += n_tok
        if n_tok > 1 and t_first is not None:
            res.tpot.append((end - t_first) / (n_tok - 1))


async def client_loop(i: int, http: httpx.AsyncClient, args, res: Results, t_end: float) -> None:
    rng = random.Random(args.seed * 1000 + i)
    await asyncio.sleep(rng.random() * 0.5)  # stagger the starts a little
    while time.perf_counter() < t_end:
        await one_request(http, args, res, rng)


async def rss_sampler(proc: psutil.Process | None, samples: list[tuple[float, int]], t0: float,
                      stop: asyncio.Event) -> None:
    while not stop.is_set():
        if proc is not None:
            try:
                samples.append((time.perf_counter() - t0, proc.memory_info().rss))
            except psutil.Error:
                return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)


async def run(args, pid: int | None) -> dict:
    res = Results()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    proc = psutil.Process(pid) if pid else None
    samples: list[tuple[float, int]] = []
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.request_timeout)) as http:
        await one_request(http, args, Results(), random.Random(0))  # warm-up, not counted
        t0 = time.perf_counter()
        stop = asyncio.Event()
        sampler = asyncio.create_task(rss_sampler(proc, samples, t0, stop))
        t_end = t0 + args.duration
        await asyncio.gather(*(client_loop(i, http, args, res, t_end) for i in range(args.clients)))
        wall = time.perf_counter() - t0
        settled = None  # seconds until nothing runs or waits; None: still busy after --settle
        t_settle = time.perf_counter()
        while time.perf_counter() - t_settle < args.settle:
            h = (await http.get("/health")).json()
            if h["running"] == 0 and h["waiting"] == 0:
                settled = time.perf_counter() - t_settle
                break
            await asyncio.sleep(0.1)
        stop.set()
        await sampler
        if proc is not None:
            samples.append((wall, proc.memory_info().rss))
        metrics = None
        try:
            r = await http.get("/metrics")
            if r.status_code == 200:
                keep = ("turbospec:request_success_total", "turbospec:generation_tokens_total",
                        "turbospec:request_errors_total")
                metrics = {ln.split()[0]: float(ln.split()[-1]) for ln in r.text.splitlines()
                           if ln.startswith(keep)}
        except httpx.HTTPError:
            pass
    n_fail = sum(res.failures.values())
    out = {
        "url": args.url, "clients": args.clients, "duration_s": args.duration, "wall_s": wall,
        "max_tokens": args.max_tokens, "chat": args.chat,
        "requests_ok": res.ok, "failures": n_fail, "failure_kinds": res.failures,
        "disconnect_frac": args.disconnect_frac, "malformed_frac": args.malformed_frac,
        "disconnected": res.disconnected, "malformed_rejected": res.rejected, "status_5xx": res.status_5xx,
        "settled_after_s": settled, "stuck": settled is None,
        "requests_per_s": res.ok / wall, "output_tokens": res.tokens, "output_tok_per_s": res.tokens / wall,
        "ttft_ms": summary(res.ttft), "tpot_ms": summary(res.tpot), "itl_ms": summary(res.itl),
        "e2e_ms": summary(res.e2e), "server_metrics": metrics,
    }
    if samples:
        rss = [s[1] for s in samples]
        k = max(1, len(rss) // 5)
        first, last = statistics.median(rss[:k]), statistics.median(rss[-k:])
        growth = last - first
        step = max(1, len(samples) // 30)
        out["rss_mib"] = {"start": rss[0] / 2**20, "first_fifth_median": first / 2**20,
                          "last_fifth_median": last / 2**20, "max": max(rss) / 2**20,
                          "growth": growth / 2**20,
                          "samples": [(round(t, 1), round(v / 2**20, 1)) for t, v in samples[::step]]}
        out["memory_flat"] = growth <= max(0.05 * first, 32 * 2**20)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_server(args) -> tuple[subprocess.Popen, str]:
    from turbospec.demo import make_demo_model

    model = args.model_path
    if model is None:
        model = str(make_demo_model(Path(tempfile.mkdtemp(prefix="ts-load-")) / "tiny", **TINY))
    port = free_port()
    cmd = [sys.executable, "-m", "turbospec.cli", "serve", "-m", model, "--port", str(port),
           "--alias", args.model, "-c", str(args.ctx), "-t", str(args.server_threads),
           "--max-queue", str(max(64, 2 * args.clients))]
    cmd += args.server_arg
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read().decode(errors='replace')[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("server did not start")


def print_report(o: dict) -> None:
    def row(name: str, s: dict) -> str:
        if not s.get("n"):
            return f"  {name:5s} -"
        return (f"  {name:5s} p50 {s['p50']:8.1f}  p90 {s['p90']:8.1f}  p99 {s['p99']:8.1f}  "
                f"mean {s['mean']:8.1f}  max {s['max']:8.1f} ms  (n={s['n']})")

    print(f"{o['clients']} clients x {o['duration_s']:.0f} s (wall {o['wall_s']:.1f} s) against {o['url']}")
    print(f"  requests ok {o['requests_ok']}, failures {o['failures']} {o['failure_kinds'] or ''}")
    print(f"  hung up on purpose {o['disconnected']}, malformed rejected with 4xx {o['malformed_rejected']}, "
          f"5xx {o['status_5xx']}; nothing running or waiting "
          + (f"{o['settled_after_s']:.1f} s after the last request" if not o["stuck"] else "-- STUCK JOBS"))
    print(f"  throughput {o['requests_per_s']:.2f} req/s, {o['output_tok_per_s']:.1f} output tok/s "
          f"({o['output_tokens']} tokens)")
    for k in ("ttft", "tpot", "itl", "e2e"):
        print(row(k, o[f"{k}_ms"]))
    if "rss_mib" in o:
        m = o["rss_mib"]
        print(f"  server RSS: start {m['start']:.0f} MiB, first-fifth median {m['first_fifth_median']:.0f}, "
              f"last-fifth median {m['last_fifth_median']:.0f}, max {m['max']:.0f}, "
              f"growth {m['growth']:+.1f} MiB -> {'flat' if o['memory_flat'] else 'GROWING'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL (loopback)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds during which new requests start")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    ap.add_argument("--model", default="tiny", help="model name sent in requests (and --alias when spawning)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--server-pid", type=int, default=None, help="PID of the server, for RSS samples")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disconnect-frac", type=float, default=0.0, help="share of requests that hang up mid-stream")
    ap.add_argument("--malformed-frac", type=float, default=0.0, help="share of requests sent malformed")
    ap.add_argument("--settle", type=float, default=10.0,
                    help="seconds allowed after the run for /health to show nothing running or waiting")
    ap.add_argument("--spawn-tiny", action="store_true",
                    help="start `turbospec serve` on a free loopback port "
                         "(tiny random model unless --model-path)")
    ap.add_argument("--model-path", default=None, help="with --spawn-tiny: serve this checkpoint instead")
    ap.add_argument("--ctx", type=int, default=1024, help="with --spawn-tiny: context size")
    ap.add_argument("--server-threads", type=int, default=1, help="with --spawn-tiny: server torch threads")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `serve` flag (repeatable)")
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    host = httpx.URL(args.url).host
    proc = None
    if args.spawn_tiny:
        proc, args.url = spawn_server(args)
    elif host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("this load test only targets loopback servers")
    pid = proc.pid if proc is not None else args.server_pid
    try:
        out = asyncio.run(run(args, pid))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    out["server_exit_code"] = proc.returncode if proc is not None else None
    out["cpu_count"] = os.cpu_count()
    print_report(out)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if out["failures"] == 0 and not out["stuck"] else 1


if __name__ == "__main__":
    sys.exit(main())
