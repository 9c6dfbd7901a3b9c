"""`turbospec` command line: run (generate), plus the lab tools as they land."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from turbospec.errors import TurboSpecError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPT = "import os\n\n\nclass FileCache:\n    def __init__(self, path):\n"


def default_model() -> str | None:
    env = os.environ.get("TURBOSPEC_MODEL")
    if env:
        return env
    for cand in (REPO_ROOT / "models" / "turbospec-tiny", REPO_ROOT / "models" / "demo-qwen3"):
        if (cand / "config.json").exists():
            return str(cand)
    return None


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("-b", "--batch-size", type=int, default=2048, help="logical batch size (default 2048)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="prefill chunk size (default 512)")
    p.add_argument("-ctk", "--cache-type-k", default=None,
                   help="K cache format: f16, bf16, f32, q8_0, q4_0, tbq4_0, turbo4, turbo3, turbo2, ... "
                        "(default: the model dtype, i.e. f32 for a float32 model)")
    p.add_argument("-ctv", "--cache-type-v", default=None, help="V cache format (as -ctk)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec-type", default=None,
                   help="speculative drafters, comma list: draft-mtp, medusa, ngram (prompt lookup), ngram-mod, "
                        "draft-model")
    p.add_argument("--spec-draft-n-max", type=int, default=3, help="max draft tokens per step (default 3)")
    p.add_argument("--spec-draft-p-min", type=float, default=0.0, help="stop drafting below this probability")
    p.add_argument("-md", "--spec-draft-model", default=None, help="draft model directory (draft-model)")
    p.add_argument("--spec-ngram-size-n", type=int, default=4, help="prompt lookup: longest n-gram to match")
    p.add_argument("--spec-ngram-mod-n-match", type=int, default=8, help="ngram-mod: tokens hashed per key")
    p.add_argument("--spec-ngram-mod-n-max", type=int, default=16, help="ngram-mod: max draft length")
    p.add_argument("--spec-medusa", default=None,
                   help="Medusa heads directory (medusa_config.json + medusa_heads.safetensors; default: the model's)")
    p.add_argument("--spec-tree", default=None,
                   help="Medusa tree: JSON list of per-head top-k rank paths, e.g. '[[0],[1],[0,0]]', or "
                        "topk:k1,k2,... (default [[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0]]); depth capped by n-max")
    p.add_argument("--spec-mtp-prompt-window", type=int, default=-1,
                   help="feed only the last N prompt positions to the MTP, so drafting costs prefill little "
                        "(default -1: a quarter of the prompt, 64..256; 0 = all)")
    p.add_argument("--spec-draft-vocab", type=int, default=-1,
                   help="MTP drafts over the N most frequent tokens (ranked by the model's draft_vocab.json, else "
                        "the lowest ids) plus the request's own; 0 = full vocab; default -1: 1024 when the model "
                        "ships draft_vocab.json, else full")
    p.add_argument("--spec-mtp-topk", type=int, default=1,
                   help="MTP draft tree: top-k candidates at every depth, the best continued (1 = a chain)")
    p.add_argument("-ctkd", "--cache-type-k-draft", default=None,
                   help="draft/MTP K cache format (f16, bf16, f32, q8_0, q4_0, tbq4_0, turbo2/3/4; "
                        "default: the model dtype)")
    p.add_argument("-ctvd", "--cache-type-v-draft", default=None, help="draft/MTP V cache format (as -ctkd)")


def spec_config(a: argparse.Namespace):
    from turbospec.spec import SpecConfig

    return SpecConfig.parse(
        a.spec_type, n_max=a.spec_draft_n_max, p_min=a.spec_draft_p_min, draft_model=a.spec_draft_model,
        ngram_n_max=a.spec_ngram_size_n, ngram_mod_n_match=a.spec_ngram_mod_n_match,
        ngram_mod_n_max=a.spec_ngram_mod_n_max, mtp_prompt_window=a.spec_mtp_prompt_window,
        draft_vocab=getattr(a, "spec_draft_vocab", -1), mtp_topk=getattr(a, "spec_mtp_topk", 1),
        draft_k_type=a.cache_type_k_draft, draft_v_type=getattr(a, "cache_type_v_draft", None),
        medusa=getattr(a, "spec_medusa", None), tree=getattr(a, "spec_tree", None),
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature, 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k, 0 = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p, 1 = off (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p, 0 = off (default 0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="repeat penalty, 1 = off (default 1.0)")
    p.add_argument("--repeat-last-n", type=int, default=64, help="penalty window (default 64)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="presence penalty (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="frequency penalty (default 0)")
    p.add_argument("-s", "--seed", type=int, default=None, help="RNG seed (default random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def sampling_params(a: argparse.Namespace):
    from turbospec.sampling import SamplingParams

    try:
        return SamplingParams(
            temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, repeat_penalty=a.repeat_penalty,
            repeat_last_n=a.repeat_last_n, presence_penalty=a.presence_penalty,
            frequency_penalty=a.frequency_penalty, seed=a.seed, max_tokens=a.n_predict, stop=list(a.stop),
            ignore_eos=a.ignore_eos,
        )
    except ValueError as e:
        raise TurboSpecError(str(e)) from None


def model_path(given: str | None) -> str:
    """The checkpoint to use: `-m` if given, else the bundled model (or TURBOSPEC_MODEL); a one-line error if
    there is none."""
    path = given or default_model()
    if path is None:
        raise TurboSpecError("no model given (-m) and no bundled model found; run scripts/make_demo_model.py")
    return path


def set_threads(n: int | None) -> None:
    import torch

    if n is not None:
        if n <= 0:
            raise TurboSpecError("--threads must be positive")
        torch.set_num_threads(n)


def kv_type_arg(name: str | None) -> str | None:
    """Validate a -ctk/-ctv value (dtype spellings like float16 accepted)."""
    from turbospec.spec import _kv_type

    return _kv_type(name)


def load_engine(a: argparse.Namespace):
    """Model + tokenizer + engine from the common flags."""
    from turbospec.engine import Engine
    from turbospec.models import load_model
    from turbospec.tokenizer import Tokenizer

    path = model_path(a.model)
    set_threads(a.threads)
    model = load_model(path, a.dtype)
    tok = Tokenizer(path) if (Path(path) / "tokenizer.json").exists() else None
    drafter = None
    if getattr(a, "spec_type", None):
        from turbospec.spec import make_drafter

        sc = spec_config(a)
        drafter = make_drafter(sc, model, a.ctx_size + sc.n_max + 1, model_path=path)
    n_max = getattr(a, "spec_draft_n_max", 3)
    eng = Engine(model, tok, ctx=a.ctx_size, ubatch=a.ubatch_size, batch=a.batch_size, drafter=drafter,
                 n_max=n_max, cache_type_k=kv_type_arg(getattr(a, "cache_type_k", None)),
                 cache_type_v=kv_type_arg(getattr(a, "cache_type_v", None)))
    return eng, path


def cmd_run(a: argparse.Namespace) -> int:
    engine, _ = load_engine(a)
    prompt = a.prompt
    if a.file:
        try:
            prompt = Path(a.file).read_text()
        except OSError as e:
            raise TurboSpecError(f"cannot read prompt file: {e}") from None
    if prompt is None:
        prompt = DEFAULT_PROMPT
    params = sampling_params(a)
    out = sys.stdout
    if not a.no_echo and not a.chat:
        out.write(prompt)
    for chunk in engine.stream(prompt, params, chat=a.chat):
        out.write(chunk.text)
        out.flush()
    out.write("\n")
    st = engine.last_stats
    print(st.line(), file=sys.stderr)
    if a.json_stats:
        Path(a.json_stats).write_text(json.dumps(st.to_dict(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="turbospec", description="Speculative decoding over compressed KV caches.")
    ap.add_argument("--version", action="version", version=f"turbospec {_version()}")
    sub = ap.add_subparsers(dest="cmd")
    r = sub.add_parser("run", help="generate text from a prompt, streaming, then print a stats line")
    add_model_args(r)
    add_spec_args(r)
    add_sampling_args(r)
    r.add_argument("-p", "--prompt", default=None, help="prompt text (default: a code prompt)")
    r.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    r.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    r.add_argument("--no-echo", action="store_true", help="do not print the prompt before the output")
    r.add_argument("--json-stats", default=None, help="also write the stats as JSON to this file")
    r.set_defaults(func=cmd_run)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    add_model_args(s)
    add_spec_args(s)
    add_sampling_args(s)
    from turbospec.server import add_serve_args, cmd_serve

    add_serve_args(s)
    s.set_defaults(func=cmd_serve)
    for name in ("tco", "bench", "fit", "quality"):
        _add_optional_tool(sub, name)
    _add_optional_tool(sub, "train-heads", "turbospec.spec.train_heads")
    return ap


def _add_optional_tool(sub, name: str, module: str | None = None) -> None:
    """Register subcommand `name` from a module with add_cli(subparsers) (and run_cli(args) as its default
    func); `module` defaults to turbospec.lab.<name>. Missing modules are skipped."""
    import importlib

    try:
        mod = importlib.import_module(module or f"turbospec.lab.{name}")
    except ImportError:
        return
    if hasattr(mod, "add_cli"):
        mod.add_cli(sub)
        parser = sub.choices.get(name)
        if parser is not None and parser.get_default("func") is None and hasattr(mod, "run_cli"):
            parser.set_defaults(func=mod.run_cli)


def _version() -> str:
    from turbospec import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "cmd", None):
        args = ap.parse_args(["run"] + (argv if argv is not None else sys.argv[1:]))
    try:
        return int(args.func(args) or 0)
    except TurboSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
