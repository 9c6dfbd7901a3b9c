"""Build an engine from an `EngineConfig`: resolve the checkpoint, set threads, load model, tokenizer, drafter."""

from __future__ import annotations

from pathlib import Path

import torch

from turbospec import device, env
from turbospec.config import EngineConfig
from turbospec.engine.engine import Engine
from turbospec.errors import TurboSpecError
from turbospec.model.base import Model
from turbospec.model.gguf import GGUFFile, is_gguf
from turbospec.model.registry import Progress, load_gguf, load_model
from turbospec.speculative.adaptive import calibrate
from turbospec.speculative.registry import make_drafter
from turbospec.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ("turbospec-tiny", "demo-qwen3")  # looked for in models/ beside the package, in this order


def default_model() -> str | None:
    """TURBOSPEC_MODEL, else the bundled model of a source checkout, else None."""
    given = env.get("TURBOSPEC_MODEL")
    if given:
        return given
    for name in BUNDLED:
        cand = REPO_ROOT / "models" / name
        if (cand / "config.json").exists():
            return str(cand)
    return None


def model_path(given: str | None) -> str:
    """The checkpoint to use: the one given, else the default; a one-line error when there is none."""
    path = given or default_model()
    if path is None:
        raise TurboSpecError("no model given (-m) and no bundled model found; run scripts/make_demo_model.py")
    return path


def load_parts(config: EngineConfig, progress: Progress | None = None) -> tuple[str, Model, Tokenizer | None]:
    """Resolve the checkpoint, apply the thread count, load the model and its tokenizer (None when the checkpoint
    ships none): what `build_engine` does before the drafter, for tools that run several engines on one model.
    `progress(done, total)`: the tensors read while the model loads (a caller's load bar)."""
    path = model_path(config.model)
    device.use(config.device)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    tokenizer: Tokenizer | None
    budget = None if config.moe_cache_mem is None else config.moe_cache_mem << 20
    from turbospec.parallel import tp

    # under torchrun: this rank's part of the model (turbospec.parallel.tp)
    shard = tp.shard_view() if tp.init_from_env()[1] > 1 else None
    if shard is not None and device.current().type != "cpu":
        raise TurboSpecError("tensor parallelism runs on CPUs (gloo) so far: pass --device cpu under torchrun")
    if shard is not None and "medusa" in config.spec.types:
        raise TurboSpecError("Medusa heads read the whole LM head, which tensor parallelism splits: use draft-mtp, "
                             "ngram or a draft model under torchrun")
    if is_gguf(path):  # one file: model and tokenizer
        f = GGUFFile(path)
        model = load_gguf(f, config.dtype, config.weights, budget, progress, shard)
        tokenizer = Tokenizer.from_gguf(f.meta) if "tokenizer.ggml.model" in f.meta else None
    else:
        model = load_model(path, config.dtype, config.weights, budget, progress, shard)
        tokenizer = Tokenizer(path) if (Path(path) / "tokenizer.json").exists() else None
    if shard is not None:
        tp.parallelize(model)
    return path, model, tokenizer


def build_engine(config: EngineConfig, progress: Progress | None = None) -> Engine:
    """Load the checkpoint, tokenizer and drafter that `config` names, and return a ready engine. `progress`: as
    `load_parts`'."""
    return assemble_engine(config, *load_parts(config, progress))


def assemble_engine(config: EngineConfig, path: str, model: Model, tokenizer: Tokenizer | None) -> Engine:
    """An engine for `config` on a model already loaded (`load_parts`): its drafter, cache and cost model. Several
    engines may share one model (`turbospec bench --interleave`)."""
    model.rope.set_context(config.ctx)  # (LongRoPE: its long frequencies past the pretrained context)
    limit = model.cfg.exact_limit()
    if limit is not None and config.ctx > limit[0]:
        raise TurboSpecError(f"-c {config.ctx}: this model has {limit[1]} from position {limit[0]} on, which "
                             f"turbospec does not implement yet; use -c {limit[0]} or less")
    drafter = make_drafter(config.spec, model, config.ctx + config.spec.depth + 1, model_path=path)
    engine = Engine(model, tokenizer, config, drafter, model_path=path)
    from turbospec.parallel import tp

    if tp.world()[1] > 1:  # rank 0 decides every step's tokens (and with --spec-adaptive its draft length)
        engine.agree = tp.rank0_choice()
        if drafter is not None and config.spec.adaptive:
            engine.agree_plan = tp.rank0_ints(longest=4)
    if drafter is not None and config.spec.adaptive:
        engine.step_costs = calibrate(model, config.spec.n_max, config.spec)  # adaptive speculation's cost model
    return engine
