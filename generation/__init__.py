"""Generation with a KV cache: the caches and the decode kernels that read them (kv_cache.py), and the
prefill/decode loop (loop.py). `generate` and `stream` are the entry; the model's own GPT.generate is the plain
nanoGPT loop."""

from generation.loop import generate, stream  # noqa: F401
