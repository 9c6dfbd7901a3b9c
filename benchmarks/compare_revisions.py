"""Two checkouts of turbospec side by side, as a user runs them: greedy output and speed through `turbospec run`.

Every repetition runs each configuration once per checkout, back to back, in alternating order (the machine's
speed drifts; paired ratios do not). Reports, per configuration: whether the greedy text is identical, median
decode and prefill t/s of each checkout, the median of the paired after/before ratios, and for speculative
configurations the speed-up over the plain configuration of the same checkout.

    python benchmarks/compare_revisions.py --before ../old-checkout --after . --reps 5 \
        --out docs/results/architecture_v2_before_after.json

Each checkout runs with its own directory first on sys.path and its own torch extension cache, so their C++
kernels are built once each and never rebuilt in between.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CODE = "import os\n\n\nclass FileCache:\n    def __init__(self, path):\n"
PROSE = "The history of the city begins with"
# name: (model, extra flags, prompt); models are paths inside the checkout unless absolute
CONFIGS = {
    "tiny code plain": ("models/turbospec-tiny", [], CODE),
    "tiny code draft-mtp": ("models/turbospec-tiny", ["--spec-type", "draft-mtp"], CODE),
    "tiny prose plain": ("models/turbospec-tiny", [], PROSE),
    "tiny prose draft-mtp": ("models/turbospec-tiny", ["--spec-type", "draft-mtp"], PROSE),
    "hybrid code plain": ("models/turbospec-tiny-hybrid", [], CODE),
    "hybrid code draft-mtp": ("models/turbospec-tiny-hybrid", ["--spec-type", "draft-mtp"], CODE),
    "hybrid code q8_0 KV": ("models/turbospec-tiny-hybrid", ["-ctk", "q8_0", "-ctv", "q8_0"], CODE),
    "tiny code turbo4 KV + ngram-mod,draft-mtp": ("models/turbospec-tiny",
                                                 ["-ctk", "turbo4", "-ctv", "turbo4", "--spec-type",
                                                  "ngram-mod,draft-mtp"], CODE),
}
ENGINE_SHAPE = "demo 40.5M bf16 512-token prompt"


def run_once(checkout: Path, ext_dir: Path, model: str, flags: list[str], prompt: str, gen: int, threads: int
             ) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stats.json"
        cmd = [sys.executable, "-m", "turbospec.cli", "run", "-m", model, "-p", prompt, "-n", str(gen), "--temp", "0",
               "--ignore-eos", "--no-echo", "-t", str(threads), "--json-stats", str(stats), *flags]
        env = dict(os.environ, PYTHONPATH=str(checkout), TORCH_EXTENSIONS_DIR=str(ext_dir))
        r = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise SystemExit(f"{checkout}: {' '.join(cmd[2:6])} failed: {r.stderr.strip()[-500:]}")
        s = json.loads(stats.read_text())
    spec = s.get("spec") or (s.get("extra") or {}).get("spec") or {}  # older checkouts: under "extra"
    return {"text": r.stdout, "decode_tps": s["decode_tps"], "prefill_tps": s["prefill_tps"],
            "mean_acceptance_length": spec.get("mean_acceptance_length")}


def revision(checkout: Path) -> str:
    """The checkout's git commit (with "+changes" when its work tree differs from it), not its path."""
    git = ["git", "-C", str(checkout)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return (head or "unknown") + ("+changes" if dirty.stdout.strip() else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the earlier checkout (repository root)")
    ap.add_argument("--after", required=True, help="the later checkout (repository root)")
    ap.add_argument("--demo-model", default=None, help="random-weight engine-speed model (scripts/make_demo_model.py)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--extra-model", nargs="*", default=[], metavar="PATH",
                    help="more models (a checkpoint or GGUF file): each adds '<file name> code plain' and "
                         "'<file name> code draft-mtp' (and '... draft-mtp adaptive' where --adaptive)")
    ap.add_argument("--adaptive", action="store_true", help="with --extra-model: also --spec-adaptive")
    ap.add_argument("--extra-kv", nargs="*", default=[], metavar="TYPE",
                    help="with --extra-model: also '<file name> code TYPE KV' (-ctk TYPE -ctv TYPE) per type")
    ap.add_argument("--configs", nargs="*", default=None, help="only these configurations (names as printed)")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    a = ap.parse_args()
    sides = {"before": Path(a.before).resolve(), "after": Path(a.after).resolve()}
    ext = {k: Path(tempfile.gettempdir()) / f"turbospec_ext_{k}" for k in sides}
    configs = dict(CONFIGS)
    if a.demo_model:
        long_prompt = " ".join(f"w{i}" for i in range(400))  # several hundred tokens for the demo tokenizer
        configs[ENGINE_SHAPE] = (str(Path(a.demo_model).resolve()), ["--dtype", "bfloat16"], long_prompt)
    for path in a.extra_model:
        name, model = Path(path).name, str(Path(path).resolve())
        configs[f"{name} code plain"] = (model, [], CODE)
        configs[f"{name} code draft-mtp"] = (model, ["--spec-type", "draft-mtp"], CODE)
        if a.adaptive:
            configs[f"{name} code draft-mtp adaptive"] = (model, ["--spec-type", "draft-mtp", "--spec-adaptive"], CODE)
        for kv in a.extra_kv:
            configs[f"{name} code {kv} KV"] = (model, ["-ctk", kv, "-ctv", kv], CODE)
    if a.configs:
        unknown = set(a.configs) - set(configs)
        if unknown:
            raise SystemExit(f"unknown configurations {sorted(unknown)} (choose from {sorted(configs)})")
        configs = {n: configs[n] for n in a.configs}
    runs: dict[str, dict[str, list[dict]]] = {c: {k: [] for k in sides} for c in configs}
    for side, path in sides.items():  # warm-up: kernel builds, page cache
        run_once(path, ext[side], *CONFIGS["tiny code plain"][:2], CODE, 8, a.threads)
    for rep in range(a.reps):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for name, (model, flags, prompt) in configs.items():
            for side in order:
                runs[name][side].append(run_once(sides[side], ext[side], model, flags, prompt, a.gen, a.threads))
        print(f"rep {rep + 1}/{a.reps} done", file=sys.stderr)
    report = {**{s: revision(p) for s, p in sides.items()}, "reps": a.reps, "gen": a.gen, "threads": a.threads,
              "command": shlex.join(["python", *sys.argv]), "configs": {}}
    print("| config | greedy text identical | decode t/s before | decode t/s after | after/before (paired) "
          "| prefill before | prefill after | spec speed-up before | spec speed-up after |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, by in runs.items():
        med = {s: statistics.median(r["decode_tps"] for r in by[s]) for s in sides}
        pre = {s: statistics.median(r["prefill_tps"] for r in by[s]) for s in sides}
        ratio = statistics.median(x["decode_tps"] / y["decode_tps"] for x, y in zip(by["after"], by["before"]))
        same = all(x["text"] == y["text"] for x, y in zip(by["after"], by["before"]))
        row = {"greedy_identical": same, "decode_tps": med, "prefill_tps": pre, "paired_ratio": ratio,
               "decode_tps_all": {s: [r["decode_tps"] for r in by[s]] for s in sides},
               "mean_acceptance_length": {s: by[s][0]["mean_acceptance_length"] for s in sides}}
        plain = (name.replace("draft-mtp adaptive", "plain").replace("draft-mtp", "plain")
                 if "draft-mtp" in name and " KV" not in name else None)
        if plain is not None and plain in runs:
            row["spec_speedup"] = {s: statistics.median(x["decode_tps"] / y["decode_tps"]
                                                        for x, y in zip(by[s], runs[plain][s])) for s in sides}
        report["configs"][name] = row
        sp = row.get("spec_speedup")
        print(f"| {name} | {'yes' if same else 'NO'} | {med['before']:.1f} | {med['after']:.1f} | {ratio:.3f}x "
              f"| {pre['before']:.0f} | {pre['after']:.0f} | "
              + (f"{sp['before']:.2f}x | {sp['after']:.2f}x |" if sp else "— | — |"))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
