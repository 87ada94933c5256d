"""Shakespeare, GPT-2 BPE: `python -m data.shakespeare.prepare`."""
