"""FineWeb-Edu, the 10B-token sample (HuggingFaceFW/fineweb-edu, config sample-10BT), as GPT-2 tokens.

Run from the repo root:
    python -m data.fineweb.prepare [--num_proc 8]              # downloads into the HF cache (large)
    python -m data.fineweb.prepare --hf_config sample-100BT    # a bigger sample
    python -m data.fineweb.prepare --dataset_path DIR_OR_FILE  # a save_to_disk folder or json/parquet/txt
Options: --out_dir DIR (default: this folder), --val_fraction F (default 0.0005) or --val_size N documents,
--hf_name, --text_column. Writes train.bin, val.bin (uint16 ids) and meta.json.
"""

import sys
from pathlib import Path

if not __package__:  # `python data/fineweb/prepare.py`: the repo's packages are importable only with -m
    print("error: run it from the repo root as: python -m data.fineweb.prepare", file=sys.stderr)
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
        hf_name="HuggingFaceFW/fineweb-edu",
        hf_config="sample-10BT",
        description=__doc__,
    )


if __name__ == "__main__":
    sys.exit(run_prepare(main))  # errors: one `error:` line, exit code 2
