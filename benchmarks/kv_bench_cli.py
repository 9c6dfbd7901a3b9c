"""KV formats against f16 through the real path: `turbospec bench` (prefill to the depth, then decode), one process
per run, the types interleaved within each round, the median of each round's ratio to f16 (issue #26 item 5's
measurement). The benchmark shape (`models/demo-qwen3`, made if missing) in float16 by default. `--spec T` also
runs every type with `--spec-type T` (rows `type+T`, their ratios still to plain f16), and with `--spec-adaptive`
also with adaptive speculation (rows `type+T+adaptive`). Every row also keeps the prefill t/s of the `--prompt`
tokens read at that depth (so MTP on against off at the same depth). `--llama-bench PATH --gguf FILE` runs
llama.cpp's `llama-bench` on a GGUF of the same weights in the same rounds, decode at the same depth
(`-d DEPTH+PROMPT -n GEN`, flash attention on, KV types `--llama-types`; rows `llama.cpp:type`, their ratios to
turbospec's f16), with its prefill of a prompt as long at that depth (`-d DEPTH -p PROMPT`; with `--categories`
the category prompt's length). At long depths, where every run fills its context itself, `--adaptive-only` drops the
always-on `--spec` runs and `--llama-decode-only` llama-bench's prompt-at-depth run.

`--llama-server PATH` runs llama.cpp's side through llama-server instead: one request reads the prompt after the
context and decodes, and the response's `timings` give both rates. `--depth-fill random` fills each depth with
random KV values in both engines (`turbospec bench --depth-fill random`; a llama.cpp sequence-state file written
here, which llama-server restores before every repetition) instead of reading that many tokens: 128K-262K contexts
in minutes. `--depth-fill prefill random` runs both fills in every round (rows `type~random`), to check that the
two give the same speeds.

    python benchmarks/kv_bench_cli.py --depths 512 8192 32768 --rounds 3 --out docs/results/kv_bench_cli.json
    python benchmarks/kv_bench_cli.py --model models/turbospec-tiny --spec draft-mtp --categories code \
        --types f16 q8_0 tbq4_0 turbo3 --depths 0 2048 8192 --gen 128 --out docs/results/kv_bench_cli_mtp.json
    python benchmarks/kv_bench_cli.py --types f16 q8_0 tbq4_0 turbo3 --depths 0 8192 32768 --prompt 512 \
        --llama-bench <llama.cpp>/build/bin/llama-bench --gguf models/demo-qwen3/bench-f16.gguf
    python benchmarks/kv_bench_cli.py --types f16 q8_0 tbq4_0 turbo3 --depths 131072 262144 --prompt 512 \
        --depth-fill random --llama-server <llama.cpp>/build/bin/llama-server --gguf models/demo-qwen3/bench-f16.gguf
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
TYPES = ["f16", "q8_0", "q4_0", "tbq4_0", "turbo4", "turbo3"]


def bench(model: str, dtype: str, kv: str, depth: int, gen: int, reps: int, spec: str | None = None,
          categories: str | None = None, adaptive: bool = False, prompt: int = 16,
          fill: str = "prefill") -> tuple[float, float | None, float, int]:
    """(decode t/s, draft acceptance rate or None, prefill t/s of the prompt at the depth, prompt tokens) of one
    `turbospec bench` run (medians over `reps` repetitions; with `categories` the prompt is that category's)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "turbospec.cli", "bench", "-m", model, "--dtype", dtype, "-d", str(depth), "-p",
               str(prompt), "-n", str(gen), "-r", str(reps), "-c", str(depth + prompt + gen + 64), "-ctk", kv, "-ctv",
               kv, "-q", "--out", out, "--depth-fill", fill, *(["--spec-type", spec] if spec else []),
               *(["--spec-adaptive"] if spec and adaptive else []), *(["--categories", categories] if categories else [])]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        row = json.loads((Path(out) / "report.json").read_text())["rows"][0]
        return row["decode_tps"], row.get("acc_rate"), row["prefill_tps"], row["n_prompt"]


def llama_bench(binary: str, gguf: str, kv: str, depth: int, prompt: int, gen: int, reps: int,
                threads: int, decode_only: bool = False) -> tuple[float, float]:
    """(decode t/s, prefill t/s) as `turbospec bench -d DEPTH -p PROMPT` measures them: the prompt read at `depth`,
    decode after it (at depth + prompt), from two `llama-bench` runs (`reps` repetitions each; llama-bench's `-d`
    fills the cache before each test, and its generation test does not read the prompt first). `decode_only`: the
    second run only (prefill 0.0)."""
    res = [0.0] if decode_only else []
    for p, n, d in ((prompt, 0, depth), (0, gen, depth + prompt))[int(decode_only):]:
        cmd = [binary, "-m", gguf, "-p", str(p), "-n", str(n), "-d", str(d), "-ctk", kv, "-ctv", kv, "-fa", "on",
               "-t", str(threads), "-r", str(reps), "-o", "json"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        res.append(json.loads(r.stdout)[0]["avg_ts"])
    return res[1], res[0]


GGML_TYPES = {"f16": 1, "q8_0": 8}  # ggml_type ids of the KV types written below
STATE_MAGIC, STATE_VERSION = 0x67677371, 3  # llama.h: LLAMA_STATE_SEQ_MAGIC ('ggsq'), LLAMA_STATE_SEQ_VERSION


def random_rows(rng, kv: str, n: int, width: int) -> bytes:
    """`n` KV rows of `width` values in ggml type `kv`: unit-normal f16, or q8_0 blocks (an f16 scale and 32 int8)."""
    import numpy as np

    if kv == "f16":
        return rng.standard_normal((n, width), dtype=np.float32).astype(np.float16).tobytes()
    blocks = np.empty((n * width // 32,), dtype=[("d", "<f2"), ("qs", "i1", 32)])
    blocks["d"] = 2.5 / 127
    blocks["qs"] = rng.integers(-127, 128, size=(len(blocks), 32), dtype=np.int8)
    return blocks.tobytes()


class GGUFShape(NamedTuple):
    arch: str
    layers: int
    heads_kv: int
    key_len: int
    val_len: int
    vocab: int


def gguf_shape(gguf: str) -> GGUFShape:
    """Architecture name, layers, KV heads, key / value lengths and vocabulary size of a dense GGUF model."""
    from gguf import GGUFReader

    meta = GGUFReader(gguf).fields
    arch = bytes(meta["general.architecture"].parts[-1]).decode()

    def num(key: str, default: int | None = None) -> int:
        f = meta.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else int(default)  # type: ignore[arg-type]

    key_len = num("attention.key_length", num("embedding_length") // num("attention.head_count"))
    return GGUFShape(arch, num("block_count"), num("attention.head_count_kv"), key_len,
                     num("attention.value_length", key_len), len(meta["tokenizer.ggml.tokens"].data))


def write_llama_state(path: Path, shape: GGUFShape, kv: str, tokens: list[int], seed: int = 0) -> None:
    """A llama.cpp sequence-state file for `tokens` with random K/V (what `llama_state_seq_save_file` writes for one
    sequence of a one-stream cache with flash attention, i.e. V not transposed; llama-server restores it with
    `POST /slots/0?action=restore`), so that llama-server resumes at that depth without reading the tokens: the
    twin of `turbospec bench --depth-fill random`. Dense attention-only models (every layer has KV), `shape` read by
    `gguf_shape`."""
    import numpy as np

    n_layer, heads_kv, key_len, val_len = shape.layers, shape.heads_kv, shape.key_len, shape.val_len
    depth, rng = len(tokens), np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(np.array([STATE_MAGIC, STATE_VERSION, depth], dtype="<u4").tobytes())
        f.write(np.array(tokens, dtype="<i4").tobytes())
        f.write(np.array([1, depth], dtype="<u4").tobytes())  # one stream; its cells
        cells = np.zeros(depth, dtype=[("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
        cells["pos"], cells["n_seq"] = np.arange(depth), 1  # each cell: its position, in sequence 0
        f.write(cells.tobytes())
        f.write(np.array([0, n_layer], dtype="<u4").tobytes())  # V not transposed; layers
        for width in [heads_kv * key_len] * n_layer + [heads_kv * val_len] * n_layer:  # every K, then every V
            row = width * 2 if kv == "f16" else width // 32 * 34
            f.write(np.array([GGML_TYPES[kv]], dtype="<i4").tobytes() + np.array([row], dtype="<u8").tobytes())
            for s in range(0, depth, 16384):
                f.write(random_rows(rng, kv, min(depth, s + 16384) - s, width))


def llama_server_at_depth(binary: str, gguf: str, kv: str, depth: int, prompt: int, gen: int, reps: int,
                          threads: int, fill: str = "random") -> tuple[float, float]:
    """(decode t/s, prefill t/s) of llama-server resuming at `depth` positions of `fill`: "random" KV
    (`write_llama_state`, restored before every repetition) or "prefill" (random tokens read once by a first,
    untimed request; every repetition resumes there from the prompt cache): the `prompt` random tokens after them
    read, then `gen` greedy tokens; the rates are the response's own `timings` (prompt_per_second,
    predicted_per_second), medians of `reps` after a warm-up."""
    import random

    import httpx
    from served_speed import free_port, server

    shape = gguf_shape(gguf)
    vocab = shape.vocab
    rng = random.Random(depth)
    tokens = [rng.randrange(3, vocab) for _ in range(depth)]
    dec, pre = [], []
    with tempfile.TemporaryDirectory() as tmp:
        if depth and fill == "random":
            write_llama_state(Path(tmp) / "depth.bin", shape, kv, tokens, seed=depth)
        port, ctx = free_port(), depth + prompt + gen + 64
        # llama-server caps a slot at the model's training context (llama-bench does not): the GGUF's value is
        # raised to the context asked for (no RoPE scaling is involved: only the cap moves)
        cmd = [binary, "-m", str(Path(gguf).resolve()), "-c", str(ctx), "-np", "1", "-fa", "on", "-ctk", kv, "-ctv",
               kv, "-t", str(threads), "--cache-ram", "0", "--slot-save-path", tmp + "/", "--port", str(port),
               "--override-kv", f"{shape.arch}.context_length=int:{ctx}"]
        with server(cmd, port) as url, httpx.Client(timeout=3600) as c:
            if depth and fill == "prefill":
                c.post(url + "/completion", json={"prompt": tokens, "n_predict": 1, "cache_prompt": True,
                                                  "id_slot": 0}).raise_for_status()
            for rep in range(reps + 1):  # the first is a warm-up
                if depth and fill == "random":
                    r = c.post(url + "/slots/0?action=restore", json={"filename": "depth.bin"})
                    if r.status_code != 200 or r.json().get("n_restored") != depth:
                        raise SystemExit(f"llama-server did not restore the {depth}-position state: {r.text}")
                elif not depth:
                    c.post(url + "/slots/0?action=erase").raise_for_status()
                rep_rng = random.Random(rep)
                p = [rep_rng.randrange(3, vocab) for _ in range(prompt)]
                body = {"prompt": tokens + p, "n_predict": gen, "temperature": 0, "ignore_eos": True,
                        "cache_prompt": True, "id_slot": 0}
                r = c.post(url + "/completion", json=body)
                r.raise_for_status()
                t = r.json()["timings"]
                if t["prompt_n"] != prompt or t.get("cache_n", depth) != depth:
                    raise SystemExit(f"llama-server did not resume at the restored depth: {t}")
                if rep:
                    dec.append(t["predicted_per_second"])
                    pre.append(t["prompt_per_second"])
    return statistics.median(dec), statistics.median(pre)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/demo-qwen3")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--types", nargs="*", default=TYPES)
    ap.add_argument("--depths", type=int, nargs="*", default=[512, 8192, 32768])
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spec", default=None, help="also run each type with this --spec-type")
    ap.add_argument("--spec-adaptive", action="store_true", help="also run each type with --spec and --spec-adaptive")
    ap.add_argument("--adaptive-only", action="store_true",
                    help="with --spec-adaptive: skip the always-on --spec runs (each run fills its context again)")
    ap.add_argument("--categories", default=None, help="bench prompt category (default: bench's)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens read at the depth (their prefill t/s)")
    ap.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench (with --gguf)")
    ap.add_argument("--gguf", default=None, help="GGUF file of the same weights for llama-bench")
    ap.add_argument("--llama-types", nargs="*", default=["f16", "q8_0", "q4_0"])
    ap.add_argument("--threads", type=int, default=2, help="llama-bench threads")
    ap.add_argument("--llama-server", default=None,
                    help="path of llama.cpp's llama-server (with --gguf): llama.cpp's rows from the server instead "
                         "of llama-bench (the prompt after the context, then decode, in one request; timings from "
                         "the response); needed for --depth-fill random")
    ap.add_argument("--depth-fill", nargs="*", choices=["prefill", "random"], default=["prefill"],
                    help="how each depth is filled (both: every round runs both, rows of random fill marked ~random): "
                         "prefill reads random tokens; random writes random KV values (turbospec bench "
                         "--depth-fill random; llama-server restores a state file of random KV)")
    ap.add_argument("--llama-decode-only", action="store_true",
                    help="skip llama-bench's prompt-at-depth run (it fills the cache again; prefill rows then 0)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if bool(a.llama_bench or a.llama_server) != bool(a.gguf) or (a.llama_bench and a.llama_server):
        ap.error("--gguf goes with one of --llama-bench and --llama-server")
    if "random" in a.depth_fill and (a.llama_bench or a.spec):
        ap.error("--depth-fill random measures plain decoding, llama.cpp through --llama-server")
    if a.adaptive_only and not a.spec_adaptive:
        ap.error("--adaptive-only goes with --spec-adaptive")
    if not (ROOT / a.model / "config.json").exists():
        from turbospec.demo import make_demo_model

        make_demo_model(ROOT / a.model)
    if "f16" not in a.types:
        a.types = ["f16", *a.types]
    meta = {"command": " ".join(["python", "benchmarks/kv_bench_cli.py", *sys.argv[1:]]), "model": a.model,
            "dtype": a.dtype, "gen": a.gen, "reps": a.reps, "rounds": a.rounds, "spec": a.spec,
            "spec_adaptive": a.spec_adaptive, "categories": a.categories, "prompt": a.prompt,
            "gguf": a.gguf, "llama_types": a.llama_types if a.llama_bench or a.llama_server else None,
            "llama": "llama-server" if a.llama_server else "llama-bench" if a.llama_bench else None,
            "depth_fill": a.depth_fill, "adaptive_only": a.adaptive_only, "llama_decode_only": a.llama_decode_only}
    rows = []
    for depth in a.depths:
        always = a.spec and not a.adaptive_only
        runs = [(t, None, False) for t in a.types] + ([(t, a.spec, False) for t in a.types] if always else [])
        runs += [(t, a.spec, True) for t in a.types] if a.spec and a.spec_adaptive else []
        llama_on = bool(a.llama_bench or a.llama_server)
        cells = []  # (name, fill, turbospec run or llama.cpp KV type)
        for fill in a.depth_fill:
            mark = "~random" if fill == "random" and len(a.depth_fill) > 1 else ""
            cells += [((t if sp is None else f"{t}+{sp}" + ("+adaptive" if ad else "")) + mark, fill, (t, sp, ad))
                      for t, sp, ad in runs]
            cells += [(f"llama.cpp:{t}{mark}", fill, t) for t in (a.llama_types if llama_on else [])]
        names = [c[0] for c in cells]
        tps: dict[str, list[float]] = {n: [] for n in names}
        acc: dict[str, list[float | None]] = {n: [] for n in names}
        pre: dict[str, list[float]] = {n: [] for n in names}
        for r in range(a.rounds):
            n_prompt = a.prompt
            for name, fill, what in cells:
                if isinstance(what, tuple):
                    t, sp, ad = what
                    speed, rate, pp, n_prompt = bench(a.model, a.dtype, t, depth, a.gen, a.reps, sp, a.categories,
                                                      ad, a.prompt, fill)
                elif a.llama_server:
                    (speed, pp), rate = llama_server_at_depth(a.llama_server, a.gguf, what, depth, n_prompt, a.gen,
                                                              a.reps, a.threads, fill), None
                else:
                    (speed, pp), rate = llama_bench(a.llama_bench, a.gguf, what, depth, n_prompt, a.gen, a.reps,
                                                    a.threads, a.llama_decode_only), None
                tps[name].append(speed)
                acc[name].append(rate)
                pre[name].append(pp)
                print(f"depth {depth} round {r} {name}: {speed:.1f} t/s, prefill {pp:.0f} t/s, acceptance {rate}",
                      flush=True)  # (a long run stopped part-way keeps what it printed)
            print(f"depth {depth} round {r}: " + ", ".join(f"{t} {v[-1]:.1f} (prefill {pre[t][-1]:.0f})"
                                                         for t, v in tps.items()), flush=True)
        for name, fill, _ in cells:
            base = "f16~random" if name.endswith("~random") else "f16"
            ratios = [x / f for x, f in zip(tps[name], tps[base])]
            rows.append({"type": name, "depth": depth, "fill": fill, "decode_tps": statistics.median(tps[name]),
                         "runs": tps[name], "ratio_vs_f16": statistics.median(ratios), "ratios": ratios,
                         "acc_rate": acc[name], "prefill_tps": statistics.median(pre[name]),
                         "prefill_runs": pre[name]})
        if a.out:  # after every depth: a long run stopped part-way keeps the depths it finished
            Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"\n{'type':>20} {'depth':>6} {'t/s':>8} {'x f16':>6} {'prefill':>8}")
    for row in rows:
        print(f"{row['type']:>20} {row['depth']:>6} {row['decode_tps']:8.1f} {row['ratio_vs_f16']:6.2f}"
              f" {row['prefill_tps']:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
