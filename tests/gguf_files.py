"""Small qwen3-shaped GGUF files written with the gguf package, for tests: hyperparameters, norms and the matrices
a test chooses (any type, given as values or as raw blocks)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def qwen3_gguf(path: Path, matrix: Callable[[int, str, int, int], tuple[np.ndarray, object]], *, hidden: int,
               ffn: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
               output: tuple[np.ndarray, object] | None = None, seed: int = 0) -> Path:
    """A qwen3 file: `matrix(layer, name, rows, cols)` gives each layer matrix as (array, raw type or None);
    F32 random token embedding, norms of ones, `output` (array, raw type) when the LM head is untied."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3")
    for add, v in ((w.add_context_length, 512), (w.add_embedding_length, hidden), (w.add_block_count, layers),
                   (w.add_feed_forward_length, ffn), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                   (w.add_key_length, head_dim), (w.add_value_length, head_dim), (w.add_layer_norm_rms_eps, 1e-6),
                   (w.add_rope_freq_base, 10000.0)):
        add(v)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, hidden)).astype(np.float32) * 0.05)
    if output is not None:
        w.add_tensor("output.weight", output[0], raw_dtype=output[1])
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
              "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    for i in range(layers):
        for name in MATRICES:
            arr, raw = matrix(i, name, *shapes[name])
            w.add_tensor(f"blk.{i}.{name}.weight", arr, raw_dtype=raw)
        for g, n in (("attn_norm", hidden), ("ffn_norm", hidden), ("attn_q_norm", head_dim),
                     ("attn_k_norm", head_dim)):
            w.add_tensor(f"blk.{i}.{g}.weight", np.ones(n, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
