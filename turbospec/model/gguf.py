"""llama.cpp GGUF files: the hyperparameters as a `ModelConfig`, and the tensors under their Hugging Face names
(dequantized by the `gguf` package to the model's dtype), so that the dense model classes build from a `.gguf`
file exactly as from a checkpoint directory.

Architectures: `qwen3`, `qwen2`, `llama` (dense). Tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K.
llama.cpp's converter permutes the query and key rows of `llama` models for its RoPE layout (Qwen models are not
permuted); `get` undoes that, so the rows are the checkpoint's again. The weights are dequantized at load time:
a quantized file runs at the speed (and memory) of the dtype it is loaded in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from turbospec.errors import TurboSpecError
from turbospec.model.config import ModelConfig
from turbospec.model.loader import IndexedSource, _one_line

ARCHS = ("qwen3", "qwen2", "llama")
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")

GLOBAL_NAMES = {  # Hugging Face name -> GGUF name
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {  # per layer: Hugging Face suffix -> GGUF suffix
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}


def is_gguf(path: str | Path) -> bool:
    """A path that names a GGUF file (by its magic bytes, or its suffix when it cannot be read)."""
    p = Path(path)
    if not p.is_file():
        return p.suffix.lower() == ".gguf"
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


class GGUFFile:
    """One GGUF file: its metadata, config and tensors (read lazily through a memory map)."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        from turbospec.tokenizer import gguf_metadata

        self.path = Path(path)
        if not self.path.is_file():
            raise TurboSpecError(f"{self.path}: no such GGUF file")
        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as e:  # noqa: BLE001 -- gguf raises ValueError/IndexError/struct errors on bad files
            raise TurboSpecError(f"{self.path.name}: corrupt or truncated GGUF file ({_one_line(e)})") from None
        self.meta = gguf_metadata(self.reader)
        self.arch = self.meta.get("general.architecture")
        if self.arch not in ARCHS:
            raise TurboSpecError(f"{self.path.name}: GGUF architecture {self.arch!r} is not supported "
                                 f"(supported: {', '.join(ARCHS)})")
        self.tensors = {t.name: t for t in self.reader.tensors}

    def key(self, name: str, default: Any = None) -> Any:
        """The architecture's metadata value `name` (e.g. "block_count" -> qwen3.block_count)."""
        return self.meta.get(f"{self.arch}.{name}", default)

    def config(self) -> ModelConfig:
        """The hyperparameters as the Hugging Face config.json the file was converted from would give them."""
        need = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
                "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads"}
        d: dict[str, Any] = {"model_type": self.arch}
        for k, hf in need.items():
            if self.key(k) is None:
                raise TurboSpecError(f"{self.path.name}: metadata {self.arch}.{k} is missing")
            d[hf] = self.key(k)
        heads = d["num_attention_heads"]
        d["num_key_value_heads"] = self.key("attention.head_count_kv", heads)
        if isinstance(heads, int) and isinstance(d["hidden_size"], int) and heads > 0:
            d["head_dim"] = self.key("attention.key_length", d["hidden_size"] // heads)
        d["rms_norm_eps"] = self.key("attention.layer_norm_rms_epsilon", 1e-6)
        d["rope_theta"] = self.key("rope.freq_base", 10000.0)
        scaling = self.key("rope.scaling.type", "none")
        if scaling not in (None, "none") or "rope_freqs.weight" in self.tensors:  # llama3 rope comes as rope_freqs
            raise TurboSpecError(f"{self.path.name}: RoPE scaling ({scaling if scaling != 'none' else 'rope_freqs'}) "
                                 "in GGUF files is not supported yet")
        d["max_position_embeddings"] = self.key("context_length", 4096)
        emb = self.tensors.get("token_embd.weight")
        if emb is None:
            raise TurboSpecError(f"{self.path.name}: tensor token_embd.weight is missing")
        d["vocab_size"] = int(emb.shape[1])  # ggml order: (hidden, vocab)
        d["tie_word_embeddings"] = "output.weight" not in self.tensors
        d["attention_bias"] = "blk.0.attn_q.bias" in self.tensors or "blk.0.attn_output.bias" in self.tensors
        d["mlp_bias"] = "blk.0.ffn_up.bias" in self.tensors
        for hf, k in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
            if k in self.meta:
                d[hf] = self.meta[k]
        return ModelConfig.from_dict(d)

    def weights(self, cfg: ModelConfig) -> GGUFWeights:
        return GGUFWeights(self, cfg)


class GGUFWeights(IndexedSource):
    """The file's tensors under Hugging Face names (a `TensorSource`: names / has / get)."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig):
        self.f, self.cfg = f, cfg
        self.index: dict[str, str] = {}
        for hf, g in GLOBAL_NAMES.items():
            if g in f.tensors:
                self.index[hf] = g
        for i in range(cfg.num_layers):
            for hf, g in LAYER_NAMES.items():
                if f"blk.{i}.{g}" in f.tensors:
                    self.index[f"model.layers.{i}.{hf}"] = f"blk.{i}.{g}"

    def get(self, name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self.index:
            raise TurboSpecError(f"{self.f.path.name}: missing tensor {name!r}")
        t = self.f.tensors[self.index[name]]
        kind = t.tensor_type.name
        if kind not in TYPES:
            raise TurboSpecError(f"{self.f.path.name}: tensor {t.name} has type {kind}, which is not supported "
                                 f"(supported: {', '.join(TYPES)})")
        rows = tuple(int(n) for n in reversed(t.shape.tolist()))  # ggml lists dims innermost first
        if shape is not None and rows != tuple(shape):
            raise TurboSpecError(f"{self.f.path.name}: tensor {t.name} has shape {rows}, the config implies {shape}")
        try:
            x = _values(t.data, t.tensor_type).reshape(rows)
        except (ValueError, IndexError) as e:  # a truncated file maps fewer bytes than the tensor needs
            raise TurboSpecError(f"{self.f.path.name}: cannot read tensor {t.name} ({_one_line(e)})") from None
        out = torch.from_numpy(x if x.flags.writeable and x.flags.c_contiguous else np.array(x))  # off the map
        if self.f.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = self.cfg.num_heads if ".q_proj." in name else self.cfg.num_kv_heads
            out = unpermute_rope(out, heads)
        return out.to(dtype) if dtype is not None else out


def _values(data: np.ndarray, qtype) -> np.ndarray:
    """A tensor's values: float arrays as they are, quantized blocks dequantized by the gguf package."""
    from gguf import GGMLQuantizationType, quants

    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return data
    return quants.dequantize(data, qtype)


def unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter permutation of a llama q/k projection (each head's rows interleaved from two
    halves), giving the checkpoint's rows back."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
