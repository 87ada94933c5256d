"""OpenWebText, GPT-2 BPE: `python -m data.openwebtext.prepare`."""
