"""Convert checkpoints:

python -m weights hf out/ckpt.pt hf-model/                  # a Hugging Face GPT-2 folder (GPT2LMHeadModel)
python -m weights safetensors out/ckpt.pt model.safetensors # the weights alone, for other tools
python -m weights merge out-lora/ckpt.pt merged.pt          # LoRA adapters merged into their base
"""

from __future__ import annotations

import sys
from pathlib import Path

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

from data.common import OneLineParser
from errors import CheckpointError
from weights.hf import export_hf
from weights.load import export_safetensors
from weights.lora import merge_checkpoint


def parse_args(argv: list[str]):
    parser = OneLineParser(prog="python -m weights", description="Convert checkpoints of this repo.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, source, target, text in (
        ("hf", "a .pt checkpoint or an out_dir", "folder to write (created if missing)", "a Hugging Face GPT-2 folder"),
        ("safetensors", "a .pt checkpoint or an out_dir", "the .safetensors file to write", "the weights alone"),
        ("merge", "a LoRA adapter checkpoint", "the .pt file to write", "adapters merged into their base"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("checkpoint", help=source)
        command.add_argument("out", help=target)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as stop:  # --help, or one `error:` line for a bad command line
        return stop.code
    source = Path(args.checkpoint)
    if args.command != "merge" and source.is_dir():
        source = source / "ckpt.pt"
    try:
        if args.command == "hf":
            out = export_hf(source, args.out)
            print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
            return 0
        out = (
            export_safetensors(source, args.out)
            if args.command == "safetensors"
            else merge_checkpoint(source, args.out)
        )
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
