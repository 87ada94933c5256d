"""Shakespeare, character level: `python data/shakespeare_char/prepare.py`."""
