"""The GGUF families of session 50 against llama.cpp itself: tiny random checkpoints of each (Llama with llama3 RoPE
scaling and a SentencePiece tokenizer, Qwen3 with YaRN, Phi-3 with SentencePiece, Phi-3 with LongRoPE, a Qwen3-Next
MoE, a Ministral 3), converted by llama.cpp's own `convert_hf_to_gguf.py`; for each file:

- turbospec's logits on the converter's file against transformers' on the checkpoint (max abs difference);
- whether `turbospec export-gguf` writes the same tensors (names, shapes, bytes) and `{arch}.*` metadata;
- greedy tokens of llama-server (f32 KV cache) and of turbospec on the converter's file (a 300-token prompt of token
  ids, `ignore_eos`): the length of the prefix where they agree, and how far apart the first token's top-3
  log-probabilities are (LongRoPE at a context past its pretrained 512 positions and within them, also against
  turbospec at the other context: llama.cpp and turbospec pick the long or short factors by the context size).

    python benchmarks/gguf_families.py --llama-cpp <llama-cpp-python sdist>/vendor/llama.cpp \\
        [--json docs/results/gguf_families_s50.json]

`--llama-cpp` is a llama.cpp source tree with `build/bin/llama-server` built (the sdist's vendored copy: see the
developers' notes); the converter needs `sentencepiece`. The bundled byte-level tokenizer is not in llama.cpp's list
of known vocabularies, so the converter is told its pre-tokenizer name ("qwen2", what `export-gguf` names it).
Qwen3-Next's key and value head sizes are equal here: llama.cpp's qwen3next assumes so."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CONVERT = """import sys
sys.path[:0] = [{tree!r} + "/gguf-py", {tree!r}]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
import runpy
runpy.run_path({tree!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""
PHI_TOKENS = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]  # llama.cpp's phi3 looks them up


def spm_model(out: Path, specials: list[str]) -> Path:
    """A SentencePiece BPE trained as Llama 2's was, on the tokenizer tests' corpus."""
    import sentencepiece as spm

    from tests.test_gguf_tokenizer import CORPUS

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(out / "sp"), vocab_size=900, model_type="bpe",
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", character_coverage=0.98, bos_id=1, eos_id=2, unk_id=0,
        max_sentence_length=100000, minloglevel=2, user_defined_symbols=specials)
    return out / "sp.model"


def checkpoints(out: Path) -> dict[str, Path]:
    """name -> a checkpoint directory with a tokenizer llama.cpp's converter reads."""
    from tests import hf_moe, hf_tiny

    sp = spm_model(out, PHI_TOKENS)
    made = {}
    for name, base in (("llama3_spm", "llama3_rope"), ("phi3", "phi3"), ("phi3_longrope", "phi3_long")):
        cfg_cls, model_cls, extra = hf_tiny.VARIANTS[base]
        extra = {**extra, "vocab_size": 900, "bos_token_id": 1, "eos_token_id": 2}
        if name == "phi3_longrope":  # 512 pretrained positions of 4096 (llama.cpp pads its context to 256s)
            extra.update(original_max_position_embeddings=512, max_position_embeddings=4096,
                         rope_parameters={**extra["rope_parameters"], "original_max_position_embeddings": 512})
        hf_tiny.VARIANTS[name] = (cfg_cls, model_cls, extra)
        p = made[name] = hf_tiny.build(name, out)
        shutil.copy(sp, p / "tokenizer.model")
        (p / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>"}))
    bundled = ROOT / "models" / "turbospec-tiny-hybrid"
    made["ministral3"] = ministral3(out / "ministral3")
    cfg_cls, model_cls, extra = hf_tiny.VARIANTS["qwen3_yarn"]
    hf_tiny.VARIANTS["qwen3_yarn_8k"] = (cfg_cls, model_cls, {**extra, "vocab_size": 8192})
    made["qwen3_yarn"] = hf_tiny.build("qwen3_yarn_8k", out)
    made["qwen3next_moe"] = hf_moe.build("qwen3_next", out, vocab_size=8192, linear_key_head_dim=16,
                                         linear_value_head_dim=16)
    for name in ("qwen3_yarn", "qwen3next_moe", "ministral3"):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(bundled / f, made[name] / f)
    return made


def ministral3(path: Path) -> Path:
    """A Ministral 3 (transformers' Ministral3ForCausalLM): YaRN with a log multiplier and attention temperature
    scaling from its 64 pretrained positions on (which turbospec leaves out: it runs up to them)."""
    import transformers

    from tests.hf_tiny import COMMON

    torch.manual_seed(5)
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
    cfg = transformers.Ministral3Config(**{**COMMON, "vocab_size": 8192, "head_dim": 16,
                                           "max_position_embeddings": 1024, "rope_parameters": rope})
    model = transformers.Ministral3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms start at 1: perturb them so they matter
        for n, w in model.named_parameters():
            if "norm" in n:
                w.add_(torch.randn_like(w) * 0.1)
    model.save_pretrained(path)
    return path


def same_file(a: Path, b: Path) -> bool:
    """The same tensors (names, shapes, bytes) and the same architecture metadata."""
    from turbospec.model.gguf_reader import GGUFContents

    x, y = GGUFContents(a), GGUFContents(b)
    arch = x.meta["general.architecture"]
    tx, ty = ({t.name: np.asarray(t.data) for t in c.tensors} for c in (x, y))
    keys = ({k: v for k, v in c.meta.items() if k.startswith(arch + ".")} for c in (x, y))
    return tx.keys() == ty.keys() and all(np.array_equal(tx[n], ty[n]) for n in tx) and next(keys) == next(keys)


def greedy_pair(server: str, path: Path, ctx: int, n: int, prompt_len: int = 300) -> dict:
    """Greedy tokens of both engines from one prompt, and the first token's top-3 log-probabilities."""
    from served_speed import free_port
    from served_speed import server as serve

    from turbospec import EngineConfig, SamplingParams, build_engine
    from turbospec.kv.plan import AttentionPlan

    eng = build_engine(EngineConfig(model=str(path), dtype="float32", ctx=ctx))
    prompt = [(37 * t + 5) % eng.model.cfg.vocab_size for t in range(prompt_len)]  # (long: RoPE matters)
    ours = eng.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]["tokens"]
    m = eng.model
    h = m.forward(torch.tensor(prompt), AttentionPlan.causal(0, len(prompt)), m.new_cache(len(prompt)))
    lp = torch.log_softmax(m.logits(h[-1:])[0], -1)
    port = free_port()
    cmd = [server, "-m", str(path), "--port", str(port), "-c", str(ctx), "-t", str(torch.get_num_threads()),
           "-np", "1", "--no-warmup", "-ctk", "f32", "-ctv", "f32"]
    with serve(cmd, port) as url:
        r = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
                                                  "return_tokens": True, "ignore_eos": True, "n_probs": 3},
                       timeout=300).json()
    theirs = r.get("tokens") or []
    agree = sum(1 for _ in itertools.takewhile(lambda ab: ab[0] == ab[1], zip(ours, theirs)))
    top = r["completion_probabilities"][0]["top_logprobs"]
    return {"ctx": ctx, "tokens": n, "equal_prefix": agree, "llama_cpp_tokens": len(theirs),
            "first_top3_logprob_max_diff": max(abs(float(lp[t["id"]]) - t["logprob"]) for t in top),
            "llama_cpp_top3": {t["id"]: t["logprob"] for t in top}, "turbospec_logprobs": lp}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree with build/bin/llama-server")
    ap.add_argument("-n", type=int, default=24, help="greedy tokens compared")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    tree = Path(a.llama_cpp).resolve()
    server = tree / "build" / "bin" / "llama-server"
    from tests.hf_tiny import hf_logits
    from turbospec.kv.plan import AttentionPlan
    from turbospec.model.gguf_export import export_gguf
    from turbospec.model.registry import load_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "convert.py").write_text(CONVERT.format(tree=str(tree), pre="qwen2"))
        for name, src in checkpoints(out).items():
            theirs = out / f"{name}.gguf"
            extra = ["--no-mtp"] if name.startswith("qwen3next") else []
            subprocess.run([sys.executable, str(out / "convert.py"), str(src), "--outtype", "f32", "--outfile",
                            str(theirs), *extra], check=True, capture_output=True, env={**os.environ})
            model = load_model(theirs, "float32")
            rope = model.cfg.rope
            row = {"checkpoint": name, "arch": model.cfg.arch,
                   "rope": "llama3 (rope_freqs)" if rope.get("freq_factors") else rope.get("rope_type")}
            # LongRoPE: the factors for the context (transformers picks them by the sequence's length: a sequence
            # past the pretrained 512 positions gets the long ones)
            for ctx, n in ((4096, 520), (512, 40)) if name == "phi3_longrope" else ((64, 60),):
                model.rope.set_context(ctx)
                seq = (torch.arange(n) * 37) % model.cfg.vocab_size
                h = model.forward(seq, AttentionPlan.causal(0, n), model.new_cache(n))
                row[f"max_abs_logit_diff_vs_transformers_ctx{ctx}"] = float(
                    (model.logits(h) - hf_logits(src, seq)).abs().max())
            row["export_gguf_same_file"] = None if name == "ministral3" else (  # (no ministral3 export)
                same_file(theirs, export_gguf(src, out / f"{name}.ours.gguf", "f32")))
            if name == "ministral3":  # within its 64 pretrained positions, where turbospec runs it
                row["greedy"] = [greedy_pair(str(server), theirs, 64, a.n, prompt_len=64 - a.n - 2)]
            else:
                row["greedy"] = [greedy_pair(str(server), theirs, ctx, a.n)
                                 for ctx in ((4096, 512) if name == "phi3_longrope" else (4096,))]
            if len(row["greedy"]) == 2:  # LongRoPE: llama.cpp's logprobs at one context against ours at the other
                for x, y in (row["greedy"], row["greedy"][::-1]):
                    x["first_top3_logprob_max_diff_vs_other_ctx"] = max(
                        abs(float(y["turbospec_logprobs"][i]) - v) for i, v in x["llama_cpp_top3"].items())
            for x in row["greedy"]:
                del x["llama_cpp_top3"], x["turbospec_logprobs"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.json:
        Path(a.json).write_text(json.dumps({"command": " ".join(["python", *sys.argv]).replace(a.llama_cpp, "<llama.cpp>"),
                                           "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
