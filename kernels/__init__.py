"""Attention kernels beyond model.py's three, each registering itself into model.py's registry on import:
flash-attn 3 and 4 (flash.py), flex_attention (flex.py), and auto's per-card order (auto.py). `import kernels`
registers them all; train.py and sample.py do."""

from kernels import auto, flash, flex  # noqa: F401  (registered on import)
