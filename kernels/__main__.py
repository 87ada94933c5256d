"""`python -m kernels`: what this machine can run, with every registered kernel (`python model.py` shows model.py's
three alone)."""

import sys

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import kernels  # noqa: F401  (registers flash-attn 3/4, flex_attention and auto's table)
import model

if __name__ == "__main__":
    sys.exit(model.main(prog="python -m kernels"))
