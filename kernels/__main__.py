"""`python -m kernels`: what this machine can run, with every registered kernel (kernels/report.py)."""

import sys

from errors import as_command

if __name__ == "__main__":  # before torch's seconds of importing: see as_command
    as_command()

import kernels  # noqa: F401  (registers flash-attn 3/4, flex_attention and auto's table)
from kernels.report import main

if __name__ == "__main__":
    sys.exit(main())
