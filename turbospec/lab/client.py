"""Client-side measurement of OpenAI-compatible servers (llama-server, vLLM, turbospec serve).

Streams /v1/completions and times every chunk: TTFT, TPOT (time per output token after the first), ITL
(inter-token latency, every gap), end-to-end latency, output t/s; draft acceptance when the server reports
llama-server style `timings.draft_n / draft_n_accepted`.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from typing import Any

from turbospec.errors import TurboSpecError
from turbospec.lab.report import env_info, summarize
from turbospec.lab.workload import BenchOptions, load_prompts

ENDPOINTS = ("/chat/completions", "/completions")  # pasted with the base URL: cut off


def api_base(url: str) -> str:
    """The OpenAI API base (ending in /v1) of a server URL given either way: `http://host:port`, with `/`,
    `/v1` or `/v1/` (as `vllm bench serve --base-url` takes the server root), or even a pasted endpoint
    (`.../v1/completions`). Requests go to `api_base(url) + "/completions"`, metrics to the root's `/metrics`."""
    base = url.strip().rstrip("/")
    for end in ENDPOINTS:
        if base.endswith(end):
            base = base[: -len(end)].rstrip("/")
            break
    return base if base.endswith("/v1") else base + "/v1"


def server_root(url: str) -> str:
    """The server's root URL (without /v1), where /metrics lives."""
    return api_base(url).removesuffix("/v1")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def stream_once(base: str, prompt: str, max_tokens: int, temp: float, seed: int, api_key: str | None,
                model: str | None, timeout: float = 600) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temp, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    req = request(api_base(base) + "/completions", api_key, body)
    t0 = time.perf_counter()
    stamps: list[float] = []
    timings: dict[str, Any] = {}
    n_tokens = 0
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if chunk.get("timings"):
                    timings = chunk["timings"]
                if chunk.get("usage") and chunk["usage"].get("completion_tokens"):
                    n_tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    if c.get("text"):
                        stamps.append(time.perf_counter())
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
        return {"ok": False, "error": " ".join(str(e).split())[:200]}
    end = time.perf_counter()
    if not stamps:
        return {"ok": False, "error": "no tokens streamed"}
    n = max(n_tokens, len(stamps))
    ttft = stamps[0] - t0
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    tpot = (end - stamps[0]) / (n - 1) if n > 1 else 0.0
    return {"ok": True, "ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3, "itl_ms": [x * 1e3 for x in itl],
            "e2e_ms": (end - t0) * 1e3, "out_tokens": n, "out_tps": n / (end - t0), "timings": timings}


FILLER_WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be",
                "by", "this", "are", "from", "or", "at")


def filler_text(n_words: int, seed: int) -> str:
    """`n_words` common English words drawn with `seed`: about one token each in BPE vocabularies (prompts and
    context depth for servers, whose tokenizer the client does not know)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(FILLER_WORDS) for _ in range(n_words))


SPEC_COUNTERS = {"draft": ("spec_decode_num_draft_tokens",), "accepted": ("spec_decode_num_accepted_tokens",)}


def request(url: str, api_key: str | None, body: dict | None = None) -> urllib.request.Request:
    """A GET of `url`, or a JSON POST of `body`, with the bearer key when there is one."""
    req = urllib.request.Request(url) if body is None else urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    return req


def scrape_spec_counters(base: str, api_key: str | None) -> dict[str, float] | None:
    """Sum the Prometheus speculative-decoding counters (vLLM `vllm:spec_decode_num_draft_tokens_total`,
    llama-server `llamacpp:spec_decode_...`, turbospec `turbospec:spec_decode_...`) at <server>/metrics."""
    req = request(server_root(base) + "/metrics", api_key)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError):
        return None
    out = {"draft": 0.0, "accepted": 0.0}
    found = False
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        metric = name.split("{")[0]
        if "per_pos" in metric or metric.endswith("_created"):
            continue
        for key, needles in SPEC_COUNTERS.items():
            if any(metric.split(":")[-1].startswith(n) for n in needles):
                try:
                    out[key] += float(value)
                    found = True
                except ValueError:
                    pass
    return out if found else None


def run_remote(urls: list[str], opts: BenchOptions, api_key: str | None = None,
               settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Measure each server (an OpenAI-compatible base URL) per context depth (that many filler words before
    the prompt) and prompt category; the report (env, settings, rows) in `turbospec.lab.bench.write_reports`'s
    format. `settings` is recorded as given (no secrets)."""
    prompts = load_prompts(opts.categories) if opts.categories else None
    if prompts is None:
        prompts = {"random": filler_text(opts.n_prompt, opts.seed)}
    rows = []
    urls = [api_base(u) for u in urls]  # http://host:port, .../v1 and .../v1/ alike
    for url, depth in itertools.product(urls, opts.depths):
        # the context filled first, as llama-bench -d: the same words every repetition (a server reuses them)
        filler = filler_text(depth, 1234 + depth) + "\n\n" if depth else ""
        for cat, prompt in prompts.items():
            runs = []
            before = None
            for rep in range(opts.warmup + opts.repetitions):
                if rep == opts.warmup:
                    before = scrape_spec_counters(url, api_key)
                # a new line per repetition after the filler: a server's prefix cache may keep the filler (as
                # the local runs keep its KV) but not the prompt, so TTFT is its prefill there as here
                text = f"{filler}[{rep}]\n{prompt}"
                r = stream_once(url, text, opts.n_gen, opts.temp, opts.seed + rep, api_key, None)
                if not r["ok"]:
                    raise TurboSpecError(f"{url}: request failed: {r['error']}")
                if rep >= opts.warmup:
                    runs.append(r)
            itl = [x for r in runs for x in r["itl_ms"]]
            row: dict[str, Any] = {"engine": url, "config": "server", "depth": depth, "category": cat,
                                   "n_gen": opts.n_gen}
            for key in ("ttft_ms", "tpot_ms", "e2e_ms", "out_tps"):
                vals = [r[key] for r in runs]
                s = summarize(vals)
                row[key], row[f"{key}_p99"], row[f"{key}_sd"] = s["median"], percentile(vals, 0.99), s["sd"]
            row["itl_median_ms"], row["itl_p99_ms"] = percentile(itl, 0.5), percentile(itl, 0.99)
            row["decode_tps"] = 1e3 / row["tpot_ms"] if row["tpot_ms"] else 0.0
            dn = sum(int(r["timings"].get("draft_n", 0) or 0) for r in runs)
            da = sum(int(r["timings"].get("draft_n_accepted", 0) or 0) for r in runs)
            if dn:
                row["acc_rate"] = da / dn
                row["acc_source"] = "timings"
            else:
                after = scrape_spec_counters(url, api_key)
                if before and after and after["draft"] > before["draft"]:
                    accepted = after["accepted"] - before["accepted"]
                    row["acc_rate"] = accepted / (after["draft"] - before["draft"])
                    row["acc_source"] = "prometheus"
            rows.append(row)
            if not opts.quiet:
                print(f"{url} [{cat}] depth {depth} ttft {row['ttft_ms']:.0f} ms, tpot {row['tpot_ms']:.1f} ms, "
                      f"out {row['out_tps']:.1f} t/s", file=sys.stderr)
    if settings is None:
        settings = {"url": list(urls), **asdict(opts)}
    return {"env": env_info(None), "settings": settings, "rows": rows}
