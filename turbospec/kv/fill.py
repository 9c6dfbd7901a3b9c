"""Random context: the attention KV of a sequence's first positions written with random values instead of computed
from tokens, so that decoding at a depth of 128K-262K positions can be measured without first reading that many
tokens (`turbospec bench --depth-fill random`, the GPU check). Attention reads every position whatever its values,
so a step costs what it costs after a real prefill; the output means nothing.
"""

from __future__ import annotations

import torch

from turbospec.kv.base import Cache
from turbospec.kv.cache import KVCache
from turbospec.kv.hybrid_cache import HybridCache
from turbospec.kv.quant_cache import QuantKVCache

CHUNK = 16384  # positions encoded at a time (bounds the float temporaries)


def fill_random(cache: Cache, depth: int, seed: int = 0) -> None:
    """Commit `depth` positions of random K (unit RMS, like k_norm's output) and V to an empty cache's attention
    layers, in the cache's own K and V formats; a hybrid's recurrent states stay at their initial values and are
    kept as a checkpoint there, so a sequence can resume at `depth` again and again."""
    kv = cache.kv if isinstance(cache, HybridCache) else cache
    if not isinstance(kv, KVCache | QuantKVCache):
        raise TypeError(f"cannot fill a {type(kv).__name__} with random values")
    if cache.length:
        raise ValueError("fill_random expects an empty cache")
    if depth > kv.max_len:
        raise ValueError(f"depth {depth} > context size {kv.max_len}")
    if isinstance(kv, KVCache):
        layers, heads, _, dim = kv.k.shape
    else:
        layers, heads, dim = kv.num_layers, kv.num_kv_heads, kv.head_dim
    dev = kv.buffers()[0].device
    g = torch.Generator(device=dev).manual_seed(seed)
    for s in range(0, depth, CHUNK):
        n = min(depth, s + CHUNK) - s
        kv.begin(n)
        for layer in range(layers):
            k, v = (torch.randn(heads, n, dim, generator=g, device=dev) for _ in "kv")
            if isinstance(kv, KVCache):
                kv.write(layer, k.to(kv.dtype), v.to(kv.dtype))
            else:
                kv.store(layer, k, v)
        kv.commit()
    cache.checkpoint()
