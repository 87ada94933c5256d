"""Dataset preparation: each subfolder has a prepare.py that writes train.bin, val.bin and meta.json."""
