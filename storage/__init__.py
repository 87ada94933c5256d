"""Files that survive a kill: atomic writes (atomic.py) and checkpoint files with their out_dir lock and rotation
(checkpoint.py). Plain dicts of tensors in and out; what a checkpoint means for a model is weights/'s."""
