"""
How much memory this process can still spend, and untrusted sizes checked against it before it is spent: a
file's or a setting's size is refused in one line instead of an allocation that fails (a traceback) or succeeds
at the cost of the machine (swapping, the OOM killer). It imports nothing of this repo but errors.

A checkpoint is a zip archive (torch.save's format); its members' sizes are declared in the archive's directory,
read here before torch.load inflates anything. torch.save stores every member uncompressed, so a compressed
member is never torch's own: it is refused unread (a few MB of deflate can declare GBs of zeros).
"""

from __future__ import annotations

import os
import resource
import zipfile
from pathlib import Path

from errors import CheckpointError

CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_memory() -> int | None:
    """Bytes this process can still allocate on the host: what the kernel reports available (MemAvailable and
    free swap), lowered by the process's cgroup limit (v2) and its address-space limit (ulimit -v); physical
    memory where /proc is not there; None where nothing can be read."""
    info = _proc_kb("/proc/meminfo")
    limits = []
    if "MemAvailable" in info:
        limits.append(info["MemAvailable"] + info.get("SwapFree", 0))
    else:
        try:
            limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            pass
    cgroup = _cgroup_headroom()
    if cgroup is not None:
        limits.append(cgroup)
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(max(0, soft - _proc_kb("/proc/self/status").get("VmSize", 0)))
    return min(limits) if limits else None


def _proc_kb(path: str) -> dict[str, int]:
    """`Name:   123 kB` lines of a /proc file, in bytes; {} where it cannot be read."""
    values = {}
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
                    values[name] = int(parts[0]) * 1024
    except OSError:
        pass
    return values


def _cgroup_headroom() -> int | None:
    """memory.max less memory.current of this process's cgroup (v2); None without a limit or a v2 cgroup."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        relative = next(line[3:] for line in lines if line.startswith("0::"))
        folder = CGROUP_ROOT / relative.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        used = int((folder / "memory.current").read_text())
    except (OSError, StopIteration, ValueError):
        return None
    return max(0, int(limit) - used) if limit.isdigit() else None


def format_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fits_in_memory(need: int) -> tuple[bool, int | None]:
    """(whether `need` bytes can be allocated, the bytes available); True where that cannot be told."""
    available = available_memory()
    return available is None or need <= available, available


def check_archive_sizes(path: Path) -> None:
    """A zip archive (a torch checkpoint) whose members torch.load could read without inflating anything beyond
    the file: every member stored uncompressed, as torch.save writes them, each within the file's size, and all
    of them within the memory available. CheckpointError (one line) naming what is wrong; nothing for a file that
    is no zip archive (torch.load says what it is)."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return
    file_bytes = path.stat().st_size
    compressed = [m for m in members if m.compress_type != zipfile.ZIP_STORED]
    if compressed:
        packed, declared = sum(m.compress_size for m in compressed), sum(m.file_size for m in compressed)
        raise CheckpointError(
            f"{path} holds {len(compressed)} compressed members ({format_bytes(packed)} declaring "
            f"{format_bytes(declared)}); torch.save stores its members uncompressed, so it was not saved by "
            f"torch.save as it is: refused unread (unzip it and save it again with torch.save)"
        )
    beyond = next((m for m in members if m.file_size > file_bytes or m.compress_size > file_bytes), None)
    if beyond is not None:
        raise CheckpointError(
            f"{path} is not a readable checkpoint: its member {beyond.filename} declares "
            f"{format_bytes(beyond.file_size)}, more than the whole file ({format_bytes(file_bytes)}); a damaged file?"
        )
    need = sum(m.file_size for m in members)
    fits, available = fits_in_memory(need)
    if not fits:
        raise CheckpointError(
            f"{path} needs {format_bytes(need)} of memory to load; {format_bytes(available)} is available; "
            f"free memory or load it on a larger machine"
        )
