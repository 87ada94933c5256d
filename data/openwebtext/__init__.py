"""OpenWebText, GPT-2 BPE: `python data/openwebtext/prepare.py`."""
