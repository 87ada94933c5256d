"""storage/memory.py: untrusted sizes checked before memory is spent. A checkpoint's zip members are read from
its directory first: a compressed member (torch.save never writes one) is refused before torch.load inflates it,
and so is a member declaring more bytes than the file holds."""

from __future__ import annotations

import struct
import zipfile

import pytest
import torch

from errors import CheckpointError
from storage.checkpoint import read_torch_file
from storage.memory import available_memory, check_archive_sizes


def recompressed(source, target, compression=zipfile.ZIP_DEFLATED):
    """The zip archive at `source` with every member written again with `compression`."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", compression) as new:
        for info in old.infolist():
            new.writestr(info.filename, old.read(info.filename))
    return target


def test_a_deflated_checkpoint_is_refused_before_it_is_inflated(tmp_path):
    """16 MB of zeros deflate to ~16 KB: the line says what it declares, and torch.load never sees it."""
    saved = tmp_path / "plain.pt"
    torch.save({"model": {"w": torch.zeros(4 * 1024 * 1024)}}, saved)
    bomb = recompressed(saved, tmp_path / "bomb.pt")
    assert bomb.stat().st_size < 100_000
    assert set(read_torch_file(saved)["model"]) == {"w"}  # torch's own save (stored members) reads as before
    with pytest.raises(CheckpointError) as error:
        read_torch_file(bomb)
    message = str(error.value)
    assert "compressed members" in message and "declaring 16.0 MiB" in message and "\n" not in message, message


def test_a_member_declaring_more_than_the_file_is_refused(tmp_path):
    saved = tmp_path / "ckpt.pt"
    torch.save({"w": torch.zeros(1000)}, saved)
    data = bytearray(saved.read_bytes())
    directory = data.rfind(b"PK\x01\x02")  # the last member's central directory entry: its uncompressed size
    data[directory + 24 : directory + 28] = struct.pack("<I", 2**31)
    saved.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="declares 2.0 GiB, more than the whole file"):
        check_archive_sizes(saved)


def test_available_memory_is_a_positive_number_of_bytes_here():
    available = available_memory()
    assert available is None or available > 0
