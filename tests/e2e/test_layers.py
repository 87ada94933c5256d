"""The shape of the repo: model.py alone is the GPT (reading pretrained weights through storage/pretrained.py, the
ground floor), the ground floor imports nothing above it, and imports go one way (the import-linter contract in
.importlinter, which CI runs as lint-imports)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OURS = ("model", "train", "sample", "configurator", "errors", "kernels", "generation", "weights", "training")
OURS += ("storage", "data", "bench", "tests", "helpers", "conftest")

LOADED = """
import json, sys
before = set(sys.modules)
{imports}
ours = {ours!r}
print(json.dumps(sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ours)))
"""

MODEL_ALONE = """
import json, logging, sys, torch
before = set(sys.modules)
from model import GPT, GPTConfig
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
for switches in ({}, {"rope": True, "norm": "rmsnorm", "mlp": "swiglu", "n_kv_head": 1, "qk_norm": True}):
    for backend in ("manual", "sdpa", "flash_attn_2"):
        config = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, attention_backend=backend,
                           **switches)
        model = GPT(config)
        idx = torch.randint(0, 64, (2, 16))
        _, loss = model(idx, idx)
        loss.backward()
        assert model.generate(idx[:1, :3], 4).shape == (1, 7)
ours = {ours!r}
print(json.dumps(sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ours)))
"""


def loaded_by(imports: str) -> list[str]:
    script = LOADED.format(imports=imports, ours=OURS)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_model_alone_loads_no_other_module_falls_back_down_the_chain_and_says_why():
    """`from model import GPT, GPTConfig` in a fresh interpreter, and a forward, backward and generate with each of
    the card's kernels and both blocks: nothing else of this repo is imported. Without the flash-attn package
    (this machine), flash_attn_2 falls back to sdpa with a WARNING naming the cause, and one INFO line names the
    backend used. (One interpreter: what the import and the use load, together, is model.py alone.)"""
    script = MODEL_ALONE.replace("{ours!r}", repr(OURS))
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["model"]
    lines = done.stderr.splitlines()
    warnings = [line for line in lines if line.startswith("WARNING flash_attn_2 requested but")]
    assert warnings and "falling back to sdpa" in warnings[0], done.stderr
    assert any(line.startswith("INFO attention backend: sdpa (requested flash_attn_2:") for line in lines)
    assert any(line == "INFO attention backend: manual" for line in lines)


def test_from_pretrained_reads_through_the_ground_floor_alone():
    """GPT.from_pretrained imports storage/pretrained.py when it is called (model.py's one import of this repo),
    and nothing else of this repo; a bad source is one ValueError."""
    call = "from model import GPT\ntry:\n    GPT.from_pretrained('no-such-source')\nexcept ValueError:\n    pass"
    assert loaded_by(call) == ["model", "storage", "storage.pretrained"]


def test_the_single_file_ground_floor_imports_nothing_above_it():
    """lint-imports checks the packages (storage and up); single-file modules are outside its graph, so what
    errors.py and configurator.py load is checked here."""
    assert loaded_by("import errors") == ["errors"]
    assert loaded_by("import configurator") == ["configurator", "errors"]
