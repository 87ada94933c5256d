"""What this machine can run: `python -m kernels` prints the versions, the GPU, every registered attention backend
(whether it trains here, and why not) and what auto picks."""

from __future__ import annotations

import contextlib
import errno
import os
import sys

import torch

from model import BACKENDS, AttentionUse, dtype_name, resolve


def attention_report(device=None) -> dict:
    """Versions, GPU, and for each backend whether it trains here and why not; what auto picks per dtype
    at T=1024 (auto) and T=32768 (auto_long), from the table or the default order (not measured)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    device = torch.device(device)
    train_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    report = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "capability": "sm{}{}".format(*capability) if capability else None,
        "dtype": dtype_name(train_dtype),
        "backends": {},
        "auto": {},
        "auto_long": {},
    }
    for name, backend in BACKENDS.items():
        why = backend.why_not(AttentionUse(device, train_dtype, training=True))
        version = getattr(backend.kernel, "version", torch.__version__)  # a flash-attn package's own
        report["backends"][name] = {"available": not why, "version": version, "why": why}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for key, seq_len in (("auto", 1024), ("auto_long", 32768)):
            report[key][dtype_name(dtype)] = resolve("auto", AttentionUse(device, dtype, seq_len=seq_len)).used
    return report


def main(argv: list[str] | None = None, prog: str = "python -m kernels") -> int:
    """Print what this machine can run (attention_report). Exit code 0; 2, with one `error:` line, for arguments
    (it takes none) or a report that cannot be written (`> /dev/full`; a closed pipe or terminal is quiet: 0)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(f"usage: {prog}\n\nPrints the attention backends this machine can run, and what auto picks.")
        return 0
    if argv:
        print(
            f"error: {prog} takes no arguments, got {' '.join(argv)!r}; it prints what this machine can run",
            file=sys.stderr,
        )
        return 2
    report = attention_report()
    gpu = f"{report['gpu']} ({report['capability']})" if report["gpu"] else "none"
    lines = [
        f"torch {report['torch']} | CUDA {report['cuda']} | cuDNN {report['cudnn']} | GPU {gpu}",
        f"device {report['device']}, training dtype {report['dtype']}:",
    ]
    for name, row in report["backends"].items():
        status = "available" if row["available"] else "unavailable"
        version = f" {row['version']}" if row["version"] else ""
        lines.append(f"  {name:<15} {status:<12}{version:<14} {row['why']}")
    for key, length in (("auto", "1024"), ("auto_long", "32768")):
        picks = ", ".join(f"{dtype} -> {used}" for dtype, used in report[key].items())
        lines.append(f"  auto picks at T={length}: {picks}")
    try:
        print("\n".join(lines), flush=True)
    except OSError as error:
        devnull = os.open(os.devnull, os.O_WRONLY)  # what stdout still buffers must not fail again at exit
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        if error.errno in (errno.EPIPE, errno.EIO):  # the reader or the terminal is gone: nobody to tell
            return 0
        with contextlib.suppress(OSError):
            print(f"error: the report could not be written to stdout ({error.strerror or error})", file=sys.stderr)
        return 2
    # a stdout that drops what fails (errors.QuietStream, under python -m kernels) says so instead of raising
    failure = getattr(sys.stdout, "failure", None)
    if failure is not None and failure.errno not in (errno.EPIPE, errno.EIO):
        with contextlib.suppress(OSError):
            print(f"error: the report could not be written to stdout ({failure.strerror or failure})", file=sys.stderr)
        return 2
    return 0
