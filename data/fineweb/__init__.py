"""FineWeb-Edu, GPT-2 BPE: `python data/fineweb/prepare.py`."""
