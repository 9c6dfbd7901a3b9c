"""Flags shared by the commands (llama.cpp's names), and turning them into configs. The only place that reads
an argparse namespace into an `EngineConfig` or `SamplingParams`."""

from __future__ import annotations

import argparse

from turbospec.config import EngineConfig, SpecConfig
from turbospec.errors import TurboSpecError
from turbospec.sampling import SamplingParams
from turbospec.weights import WEIGHT_CHOICES


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES,
                   help="matrices: auto = as stored (float in --dtype; a GGUF file's Q8_0/Q4_0/Q4_K blocks stay "
                        "packed), or quantize float matrices at load to q8_0 | q4_0 | q4_k (default auto)")
    p.add_argument("--moe-cache-mem", type=int, default=None, metavar="MIB",
                   help="mixture-of-experts models: MiB of routed experts kept in memory; an expert loads when a "
                        "token first routes to it (a GGUF file's packed experts are mapped, not copied) and the least "
                        "recently used go first (default: every expert loaded at start)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("-b", "--batch-size", type=int, default=2048, help="logical batch size (default 2048)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="prefill chunk size (default 512)")
    p.add_argument("-ctk", "--cache-type-k", default=None,
                   help="K cache format: f16, bf16, f32, q8_0, q4_0, tbq4_0, turbo4, turbo3, turbo2, ... "
                        "(default: the model dtype, i.e. f32 for a float32 model)")
    p.add_argument("-ctv", "--cache-type-v", default=None, help="V cache format (as -ctk)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--device", default="auto",
                   help="cpu | cuda | cuda:N: where the model computes (default auto: cuda when torch sees a GPU)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="recompute every prompt in full instead of reusing the KV of the prefix it shares with the "
                        "previous request (on a shared server, that reuse shows in another client's timings)")


def add_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-tp", "--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, metavar="N",
                   help="split the model over N processes on this host (tensor parallelism through torchrun and "
                        "gloo; -t is per process, default the cores split evenly) (default 1)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec-type", default=None,
                   help="speculative drafters, comma list: draft-mtp, medusa, ngram (prompt lookup), ngram-mod, "
                        "suffix, draft-model")
    p.add_argument("--spec-draft-n-max", type=int, default=3, help="max draft tokens per step (default 3)")
    p.add_argument("--spec-draft-p-min", type=float, default=0.0, help="stop drafting below this probability")
    p.add_argument("--spec-adaptive", dest="spec_adaptive", action="store_true",
                   help="each step drafts the length that pays most by a measured cost model and the running "
                        "acceptance, none when drafting does not pay (with -np N: the batch drafts while its drafting "
                        "steps emit tokens faster than plain ones); default: always up to --spec-draft-n-max")
    p.add_argument("-md", "--spec-draft-model", default=None, help="draft model directory (draft-model)")
    p.add_argument("--spec-ngram-size-n", type=int, default=4, help="prompt lookup: longest n-gram to match")
    p.add_argument("--spec-ngram-mod-n-match", type=int, default=8, help="ngram-mod: tokens hashed per key")
    p.add_argument("--spec-ngram-mod-n-max", type=int, default=16, help="ngram-mod: max draft length")
    p.add_argument("--spec-ngram-mod-shared", action="store_true",
                   help="ngram-mod: keep the pool across requests (llama.cpp's behaviour; a server's clients then "
                        "draft from, and can time, each other's text) (default: a fresh pool per request)")
    p.add_argument("--spec-suffix-n-max", type=int, default=24, help="suffix: max draft tokens per step (default 24)")
    p.add_argument("--spec-suffix-factor", type=float, default=1.0,
                   help="suffix: draft at most this many tokens per matched token (default 1.0)")
    p.add_argument("--spec-suffix-p-min", type=float, default=0.1,
                   help="suffix: a draft branch needs this share of the matches that continue there (default 0.1)")
    p.add_argument("--spec-suffix-shared", action="store_true",
                   help="suffix: also draft from earlier requests' prompts and outputs (a server's clients then "
                        "draft from, and can time, each other's text) (default: the request's own tokens only)")
    p.add_argument("--spec-suffix-store", type=int, default=1 << 18,
                   help="suffix: tokens of earlier requests kept with --spec-suffix-shared (default 262144)")
    p.add_argument("--spec-draft-argmax", dest="spec_draft_sample", action="store_false",
                   help="at temperature > 0 the MTP drafts its argmax (top-k) tokens instead of drawing them from its "
                        "own distribution (default: drawn, verified by rejection sampling)")
    p.add_argument("--spec-merge", action="store_true",
                   help="with several drafters: all draft every step and their drafts are verified together as one "
                        "tree (default: the first drafter with a draft)")
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


def add_sampling_args(p: argparse.ArgumentParser, n_help: str = "tokens to generate (default 128)") -> None:
    p.add_argument("-n", "--n-predict", type=int, default=128, help=n_help)
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


def spec_config(a: argparse.Namespace) -> SpecConfig:
    """The --spec-* flags (speculation off when the command has none)."""
    if "spec_type" not in a:
        return SpecConfig()
    return SpecConfig.parse(
        a.spec_type, n_max=a.spec_draft_n_max, p_min=a.spec_draft_p_min, draft_model=a.spec_draft_model,
        ngram_n_max=a.spec_ngram_size_n, ngram_mod_n_match=a.spec_ngram_mod_n_match,
        ngram_mod_n_max=a.spec_ngram_mod_n_max, ngram_mod_shared=a.spec_ngram_mod_shared,
        suffix_n_max=a.spec_suffix_n_max, suffix_factor=a.spec_suffix_factor, suffix_p_min=a.spec_suffix_p_min,
        suffix_shared=a.spec_suffix_shared, suffix_store_tokens=a.spec_suffix_store, merge=a.spec_merge, draft_sample=a.spec_draft_sample,
        mtp_prompt_window=a.spec_mtp_prompt_window,
        draft_vocab=a.spec_draft_vocab, mtp_topk=a.spec_mtp_topk, draft_k_type=a.cache_type_k_draft,
        draft_v_type=a.cache_type_v_draft, medusa=a.spec_medusa, tree=a.spec_tree, adaptive=a.spec_adaptive,
    )


def engine_config(a: argparse.Namespace) -> EngineConfig:
    """The model flags (+ --spec-* flags where the command has them) as an EngineConfig."""
    return EngineConfig(
        model=a.model, dtype=a.dtype, weights=a.weights, threads=a.threads, device=a.device, ctx=a.ctx_size, batch=a.batch_size, ubatch=a.ubatch_size,
        cache_type_k=a.cache_type_k, cache_type_v=a.cache_type_v, spec=spec_config(a),
        prefix_cache=not a.no_prefix_cache, moe_cache_mem=a.moe_cache_mem,
    )


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, repeat_penalty=a.repeat_penalty,
            repeat_last_n=a.repeat_last_n, presence_penalty=a.presence_penalty,
            frequency_penalty=a.frequency_penalty, seed=a.seed, max_tokens=a.n_predict, stop=list(a.stop),
            ignore_eos=a.ignore_eos,
        )
    except ValueError as e:
        raise TurboSpecError(str(e)) from None


def add_plot_format_arg(p: argparse.ArgumentParser, default: str | None = "png", what: str = "the plots") -> None:
    """`--plot-format png,svg`: the formats `turbospec.lab.plots` writes (a tuple, or None when not given and
    `default` is None)."""
    from turbospec.lab.plots import parse_formats

    def formats(text: str) -> tuple[str, ...]:
        try:
            return parse_formats(text)
        except TurboSpecError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    p.add_argument("--plot-format", type=formats, default=None if default is None else formats(default),
                   metavar="png,svg", help=f"formats of {what}, a comma list: png, svg "
                                           f"(default {default or 'the suffix of --plot'})")
