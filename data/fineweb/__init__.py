"""FineWeb-Edu, GPT-2 BPE: `python -m data.fineweb.prepare`."""
