"""Shakespeare, character level: `python -m data.shakespeare_char.prepare`."""
