"""`turbospec fit -np N` against a measured server: the peak resident memory of `turbospec serve -np N` once N
requests have filled its KV pool, next to what `fit` predicts for the same flags.

For every case (serve flags that fit takes as well: -ctk/-ctv, --dtype, --spec-type), the server starts with
`-np N -c CTX`, N streamed greedy requests run at once, each a prompt of random token ids (n-grams that never repeat:
the drafters' tables at their largest) and --gen tokens, sized so that together they fill the pool; then the
server's peak RSS (VmHWM of /proc/PID/status) is read and the server stopped. The runtime baseline is measured the
same way first: a server of a minimal model (1 layer, hidden 64, vocabulary 320) after one request, passed to fit
as --runtime-overhead (a server imports more than `turbospec run`).

    python benchmarks/fit_serve.py --model models/turbospec-tiny -np 4 -c 16384 \\
        --cases "" "--spec-type draft-mtp" "--spec-type ngram,suffix" --json docs/results/fit_serve.json
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served_speed import free_port, server, stream  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def served_peak(model: str, flags: list[str], parallel: int, ctx: int, prompt: int, gen: int, vocab: int,
                threads: int) -> int:
    """Peak RSS of a server that ran `parallel` requests of `prompt` random tokens + `gen` at once."""
    port = free_port()
    cmd = ["turbospec", "serve", "-m", model, "-np", str(parallel), "-c", str(ctx), "-t", str(threads), "--port",
           str(port), *flags]
    procs: list = []
    with server(cmd, port, procs=procs) as url:  # (VmHWM is the exec'd server's own: nothing of this process's)
        errors: list[BaseException] = []

        def one(i: int) -> None:
            rnd = random.Random(1000 + i)
            try:
                with httpx.Client(timeout=3600) as c:
                    stream(c, url, [rnd.randrange(3, vocab) for _ in range(prompt)], gen)
            except BaseException as e:  # noqa: BLE001 -- reported below
                errors.append(e)

        jobs = [threading.Thread(target=one, args=(i,)) for i in range(parallel)]
        for j in jobs:
            j.start()
        for j in jobs:
            j.join()
        if errors:
            raise RuntimeError(f"a request failed: {errors[0]!r}")
        return peak_rss(procs[0].pid)


def fit_total(model: str, flags: list[str], parallel: int, ctx: int, runtime: int) -> dict:
    """fit's prediction at -c CTX for these flags: the speculative row when --spec-type is given, else base."""
    keep, it = [], iter(flags)
    for f in it:  # the flags fit understands (serve's spelling)
        if f in ("-ctk", "--cache-type-k", "-ctv", "--cache-type-v", "--dtype", "--spec-type", "-ub"):
            keep += [f, next(it)]
    cmd = ["turbospec", "fit", "-m", model, "--mem", "1TiB", "-np", str(parallel), "-c", str(ctx),
           "--runtime-overhead", str(runtime), "--json", *keep]
    if "-ctk" not in keep and "--cache-type-k" not in keep:
        cmd += ["-ctk", "f32" if "--dtype" not in keep else "f16"]
    if "--spec-type" not in keep:
        cmd += ["--no-mtp"]
    d = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout)
    row = d["rows"][-1]
    return {"mode": row["mode"], **{k: v for k, v in row["at_ctx"].items() if isinstance(v, int) and v}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "turbospec-tiny"))
    ap.add_argument("-np", "--parallel", type=int, default=4)
    ap.add_argument("-c", "--ctx", type=int, default=16384)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--cases", nargs="+", default=["", "--spec-type draft-mtp", "--spec-type ngram,suffix"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    vocab = cfg["vocab_size"]
    per_seq = a.ctx // a.parallel
    prompt = per_seq - a.gen - 256  # (room for drafts and for whole 256-position blocks)

    from turbospec.demo import make_demo_model

    with tempfile.TemporaryDirectory() as td:
        tiny = make_demo_model(Path(td) / "m", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=320)
        base = served_peak(str(tiny), [], 2, 1024, 64, 8, 320, a.threads)
    print(f"server baseline (minimal model, one request each in 2 slots): {base / 2**20:.1f} MiB", flush=True)
    rows = []
    for case in a.cases:
        flags = shlex.split(case)
        measured = served_peak(a.model, flags, a.parallel, a.ctx, prompt, a.gen, vocab, a.threads)
        pred = fit_total(a.model, flags, a.parallel, a.ctx, base)
        err = (pred["total"] - measured) / measured
        rows.append({"flags": case, "measured": measured, "predicted": pred["total"], "error": round(err, 4),
                     "fit": pred})
        print(f"{case or '(plain)':32s} measured {measured / 2**20:7.1f} MiB  fit {pred['total'] / 2**20:7.1f} MiB"
              f"  ({100 * err:+.1f}%)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"command": "python " + " ".join(shlex.quote(x) for x in sys.argv),
                                            "server_baseline": base, "parallel": a.parallel, "ctx": a.ctx,
                                            "prompt_tokens": prompt, "gen_tokens": a.gen, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
