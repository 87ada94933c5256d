"""Shakespeare, GPT-2 BPE: `python data/shakespeare/prepare.py`."""
