"""OpenWebText (Skylion007/openwebtext on the Hugging Face hub) as GPT-2 tokens, as in nanoGPT.

Run from the repo root:
    python -m data.openwebtext.prepare [--num_proc 8]              # downloads into the HF cache (large)
    python -m data.openwebtext.prepare --dataset_path DIR_OR_FILE  # a save_to_disk folder or json/parquet/txt
Options: --out_dir DIR (default: this folder), --val_fraction F (default 0.0005) or --val_size N documents,
--hf_name/--hf_config, --text_column. Writes train.bin, val.bin (uint16 ids) and meta.json.
"""

import sys
from pathlib import Path

if not __package__:  # `python data/openwebtext/prepare.py`: the repo's packages are importable only with -m
    print("error: run it from the repo root as: python -m data.openwebtext.prepare", file=sys.stderr)
    sys.exit(2)

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

from data.common import run_prepare  # noqa: E402
from data.hf import hf_prepare_main  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    return hf_prepare_main(
        argv,
        default_out_dir=Path(__file__).parent,
        hf_name="Skylion007/openwebtext",
        hf_config=None,
        description=__doc__,
    )


if __name__ == "__main__":
    sys.exit(run_prepare(main))  # errors: one `error:` line, exit code 2
