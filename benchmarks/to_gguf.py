"""Write a dense qwen3 checkpoint (e.g. the engine-core benchmark model from `turbospec.demo`) as a GGUF file that
llama.cpp loads, so that `llama-bench` can decode *the same weights* side by side with turbospec.

The tokenizer is a placeholder (a gpt2-style vocabulary of `<t{i}>` strings without merges): llama-bench feeds
token ids and never detokenizes, so speed is unaffected. Tensors are written in f32, f16 or bf16 (`--type`).

    python benchmarks/to_gguf.py --model <checkpoint dir> --type f16 --out /tmp/bench-f16.gguf
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from turbospec.model.gguf import LAYER_NAMES  # HF suffix (per layer) -> GGUF suffix, as llama.cpp names them


def load_tensors(model: Path) -> dict[str, np.ndarray]:
    import torch
    from safetensors.torch import load_file

    out = {}
    for f in sorted(model.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            out[k] = v.to(torch.float32).numpy()
    return out


def convert(model: Path, out: Path, wtype: str) -> None:
    import gguf

    cfg = json.loads((model / "config.json").read_text())
    if cfg.get("model_type") != "qwen3":
        raise SystemExit(f"only dense qwen3 checkpoints are supported, got {cfg.get('model_type')!r}")
    t = load_tensors(model)
    w = gguf.GGUFWriter(str(out), "qwen3")
    n_layers, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
    w.add_name("turbospec-bench")
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(float(cfg.get("rope_theta", 1e6)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16}.get(
        wtype, gguf.LlamaFileType.ALL_F32))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    # ("<", "t" and "<t" are in the vocabulary so that the merge below is a valid BPE rule for tokenizers too)
    w.add_token_list(["<t0>", "<t1>", "<", "t", "<t"] + [f"<t{i}>" for i in range(5, vocab)])
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_token_merges(["< t"])  # llama.cpp requires the key; never used
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def put(name: str, arr: np.ndarray) -> None:
        # matrices in the requested type, norms (1-D) in f32 as llama.cpp's converter does
        if wtype == "bf16" and arr.ndim == 2:
            qt = gguf.GGMLQuantizationType.BF16
            w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), qt), raw_dtype=qt)
            return
        arr = arr.astype(np.float16 if wtype == "f16" and arr.ndim == 2 else np.float32)
        w.add_tensor(name, arr)

    put("token_embd.weight", t["model.embed_tokens.weight"])
    for i in range(n_layers):
        for hf, gg in LAYER_NAMES.items():
            if f"model.layers.{i}.{hf}" in t:  # (biases and q/k norms only where the architecture has them)
                put(f"blk.{i}.{gg}", t[f"model.layers.{i}.{hf}"])
    put("output_norm.weight", t["model.norm.weight"])
    if "lm_head.weight" in t and not cfg.get("tie_word_embeddings", False):
        put("output.weight", t["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--type", choices=["f32", "f16", "bf16"], default="f16")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    convert(Path(a.model), Path(a.out), a.type)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
