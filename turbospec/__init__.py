"""turbospec: speculative decoding over compressed KV caches, and a lab that measures it."""

__version__ = "0.1.0"
