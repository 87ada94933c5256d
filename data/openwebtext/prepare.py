"""OpenWebText (Skylion007/openwebtext on the Hugging Face hub) as GPT-2 tokens, as in nanoGPT.

Run from anywhere (`python -m data.openwebtext.prepare` from the repo root is the same):
    python data/openwebtext/prepare.py [--num_proc 8]              # downloads into the HF cache (large)
    python data/openwebtext/prepare.py --dataset_path DIR_OR_FILE  # a save_to_disk folder or json/parquet/txt
Options: --out_dir DIR (default: this folder), --val_fraction F (default 0.0005) or --val_size N documents,
--hf_name/--hf_config, --text_column. Writes train.bin, val.bin (uint16 ids) and meta.json.
"""

import os
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run by its path (nanoGPT's way): again as the module
    repo = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (repo, os.environ.get("PYTHONPATH"))))
    os.execv(sys.executable, [sys.executable, "-m", "data.openwebtext.prepare", *sys.argv[1:]])

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
