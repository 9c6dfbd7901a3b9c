"""turbospec: speculative decoding over compressed KV caches, and a lab that measures it.

    from turbospec import EngineConfig, SamplingParams, build_engine

    engine = build_engine(EngineConfig(model="models/turbospec-tiny"))
    out = engine.generate(["def add(a, b):"], SamplingParams(max_tokens=32, temperature=0))[0]
    print(out["text"], out["stats"].decode_tps)
"""

from turbospec.config import EngineConfig, SpecConfig
from turbospec.engine import Engine, GenStats, build_engine
from turbospec.errors import TurboSpecError
from turbospec.sampling import SamplingParams
from turbospec.version import __version__

__all__ = ["Engine", "EngineConfig", "GenStats", "SamplingParams", "SpecConfig", "TurboSpecError", "build_engine",
           "__version__"]
