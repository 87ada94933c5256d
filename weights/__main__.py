"""Convert checkpoints:

python -m weights hf out/ckpt.pt hf-model/                  # a Hugging Face GPT-2 folder (GPT2LMHeadModel)
python -m weights safetensors out/ckpt.pt model.safetensors # the weights alone, for other tools
python -m weights merge out-lora/ckpt.pt merged.pt          # LoRA adapters merged into their base

Each refuses to write into the out_dir of a run training now, to replace a checkpoint a run can resume from
unless given --overwrite (storage/targets.py), and to export weights that hold NaN or inf.
"""

from __future__ import annotations

import sys
from pathlib import Path

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

from data.common import OneLineParser
from errors import CheckpointError
from storage.targets import check_output_file
from weights.hf import export_hf
from weights.load import check_finite_weights, export_safetensors, load_checkpoint, refuse_adapters
from weights.lora import merge_checkpoint

HF_FILES = ("config.json", "model.safetensors")  # what `hf` writes into its folder
EXAMPLES = {"safetensors": "model.safetensors", "merge": "merged.pt"}


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
        command.add_argument(
            "--overwrite",
            action="store_true",
            help="replace a checkpoint a run can resume from (never in the out_dir of a run training now)",
        )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as stop:  # --help, or one `error:` line for a bad command line
        return stop.code
    source = Path(args.checkpoint).expanduser()
    if args.command != "merge" and source.is_dir():
        source = source / "ckpt.pt"
    try:
        if args.command == "hf":
            folder = Path(args.out).expanduser()
            for name in HF_FILES if folder.is_dir() else ():  # a missing folder is created; nothing to replace
                check_output_file(folder / name, overwrite=args.overwrite, inputs=[source])
            out = export_hf(finite_export_state(source), folder).resolve()
            print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
            return 0
        out = check_output_file(args.out, overwrite=args.overwrite, inputs=[source], example=EXAMPLES[args.command])
        written = export_safetensors(source, out) if args.command == "safetensors" else merge_checkpoint(source, out)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


def finite_export_state(source: Path) -> dict:
    """A plain checkpoint with finite weights, for export_hf."""
    state = load_checkpoint(source)
    refuse_adapters(state, source)
    check_finite_weights(state["model"], source, "an export of them is of no use to any tool")
    return state


if __name__ == "__main__":
    sys.exit(main())
