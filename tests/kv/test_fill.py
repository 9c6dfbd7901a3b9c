import pytest
import torch

from turbospec.kv.cache import KVCache
from turbospec.kv.fill import CHUNK, fill_random
from turbospec.kv.hybrid_cache import HybridCache
from turbospec.kv.quant_cache import make_kv_cache


@pytest.mark.parametrize("kv", [None, "q8_0", "tbq4_0", "turbo3"])
def test_fill_random_commits_finite_distinct_values_in_every_layer(kv):
    depth = CHUNK + 5  # two chunks
    cache = make_kv_cache(3, 2, 64, depth + 8, torch.float32, kv, kv)
    fill_random(cache, depth)
    assert cache.length == depth and cache.pending == 0
    for layer in range(3):
        if isinstance(cache, KVCache):
            k, v = cache.k[layer, :, :depth], cache.v[layer, :, :depth]
        else:
            k, v = cache.read(layer, 0, depth)
        assert torch.isfinite(k).all() and torch.isfinite(v).all()
        assert 0.5 < k.float().pow(2).mean().sqrt() < 2  # unit RMS, as a normed key
        assert not torch.equal(k[:, :CHUNK], k[:, CHUNK:].repeat(1, CHUNK // 5 + 1, 1)[:, :CHUNK])
    if isinstance(cache, KVCache):
        assert not torch.equal(cache.k[0, :, :depth], cache.k[1, :, :depth])
        assert cache.k[0, :, depth:].abs().sum() == 0  # nothing past the depth


def test_fill_random_keeps_a_hybrid_checkpoint_and_refuses_a_used_cache():
    cache = HybridCache(2, 2, 64, 3, (8, 4), (2, 16, 16), 256, torch.float32, max_checkpoints=2)
    fill_random(cache, 100)
    assert cache.length == 100 and cache.checkpoints == [100]  # the sequence can come back to the depth
    with pytest.raises(ValueError, match="empty"):
        fill_random(cache, 10)
    with pytest.raises(ValueError, match="context size"):
        fill_random(make_kv_cache(1, 1, 64, 16, torch.float32), 17)
