"""Every path a user takes, end to end on this machine's GPU(s), as a user runs it (train.py, sample.py and the
weights commands in a subprocess), with small models on real text (this repo's own sources): train.py per backend x
{plain, packed documents} x {compiled, eager}; a resume after a stop; FP8 training, and its resume with and without
FP8; sample.py per KV cache x {eager, compiled} x {inside block_size, sliding past it} x {1 prompt, 4 of mixed
lengths}; LoRA train -> sample -> merge in bf16; a Hugging Face GPT-2 folder in -> sample, and export ->
transformers loads it; under torchrun on 2 GPUs DDP (also with each block compiled apart, and with FP8), FSDP (also
with FP8), DDP with the optimizer step sharded (and profiled), and context parallelism (also with block
recomputation); and sample.py's decode speed, each speed cell with the GPU to itself.

    python -m pytest -m gpu tests/gpu                 # every cell; bench/results/<card>-e2e.json and .md
    python -m pytest -m gpu tests/gpu -k "train and flex"

A train cell passes when its loss is finite, falls, and ends within 0.15 nats of sdpa's run with the same seed and
settings. Figures (val loss, decode tokens/s) are a sanity check of each path, not benchmarks, except the speed
cells'. A cell whose GPUs or packages are missing, or whose backend train.py falls back from, is skipped saying why.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from gpu.runs import needs, once, report, run_cell

pytestmark = [pytest.mark.gpu, needs()]

MODEL = ["--n_layer=4", "--n_head=4", "--n_embd=128", "--block_size=256", "--batch_size=16", "--dropout=0.0"]
# FP8 converts a linear only where it pays (training/fp8.py's `converts`): at width 384 the MLP's first linear
# (384 -> 1536) is one, so these runs do use FP8 matmuls
FP8_MODEL = ["--n_layer=4", "--n_head=6", "--n_embd=384", "--block_size=256", "--batch_size=16", "--dropout=0.0"]
TRAIN = ["--max_iters=40", "--eval_interval=40", "--eval_iters=8", "--log_interval=10", "--seed=1337"]
LOSS_NOISE = 0.15  # nats: same seed, different kernels (bf16 rounding differs from step one)
FLASH_PACKAGES = {  # what each flash backend imports (flash-attn 3 under either of its module names)
    "flash_attn_2": ("flash_attn",),
    "flash_attn_3": ("flash_attn_interface|flash_attn_3",),
    "flash_attn_4": ("flash_attn.cute",),
}
BACKENDS = ("sdpa", "manual", "flex_attention", "flash_attn_2", "flash_attn_3", "flash_attn_4")


def train_command(data: Path, out_dir: Path, *settings: str) -> list[str]:
    return [sys.executable, "train.py", f"--data_dir={data}", f"--out_dir={out_dir}", *settings]


def copy_of(out_dir: str, tmp_path: Path) -> Path:
    """A copy of a shared cell's out_dir that this cell may change."""
    return Path(shutil.copytree(out_dir, tmp_path / Path(out_dir).name))


def passed(outcome: dict) -> dict:
    """A shared cell's outcome, for a cell that needs it to have passed."""
    if outcome["status"] != "ok":
        pytest.fail(f"needs {outcome['name']}, which did not pass: {outcome['status']}")
    return outcome


# ----------------------------------------------------------------------------------------------
# Cells that others need: each runs once, its test reports it and the cells that need it read its out_dir


def shared_cell(folder: Path, name: str, command: list[str], read: str = "train", **extra) -> dict:
    return once(folder, name, lambda: {**run_cell(command, read), "name": name, **extra})


@pytest.fixture(scope="session")
def base_model(shared_folder, corpus) -> dict:
    """The checkpoint the sampling, LoRA and export cells read."""
    out = shared_folder / "base"
    settings = [*MODEL, "--eval_iters=4", "--dtype=bfloat16", "--max_iters=60", "--eval_interval=30"]
    return shared_cell(shared_folder, "base model", train_command(corpus, out, *settings), out_dir=str(out))


@pytest.fixture(scope="session")
def stopped_run(shared_folder, corpus) -> dict:
    out = shared_folder / "resume"
    settings = [*MODEL, "--eval_iters=4", "--dtype=bfloat16", "--max_iters=20", "--eval_interval=20"]
    return shared_cell(shared_folder, "resume: first run", train_command(corpus, out, *settings), out_dir=str(out))


@pytest.fixture(scope="session")
def fp8_run(shared_folder, corpus) -> dict:
    """Trains with FP8 matmuls, or skips every cell that needs it saying why it cannot (a card below sm89)."""
    skip_without_fp8()
    out = shared_folder / "fp8"
    settings = [*FP8_MODEL, *TRAIN, "--eval_interval=20", "--dtype=bfloat16", "--compile=true", "--fp8=tensorwise"]
    return shared_cell(shared_folder, "train fp8 tensorwise", train_command(corpus, out, *settings), out_dir=str(out))


@pytest.fixture(scope="session")
def lora_run(shared_folder, corpus, base_model) -> dict:
    out = shared_folder / "lora"
    settings = [f"--init_from={passed(base_model)['out_dir']}", "--lora_rank=8", "--max_iters=20"]
    settings += ["--eval_interval=20", "--eval_iters=4", "--dtype=bfloat16", "--batch_size=16"]
    return shared_cell(shared_folder, "lora train", train_command(corpus, out, *settings), out_dir=str(out))


@pytest.fixture(scope="session")
def hf_folder(shared_folder) -> dict:
    """A tiny Hugging Face GPT-2 folder, as transformers saves one."""
    folder = shared_folder / "hf-gpt2"
    make = "import transformers as t; t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_head=2, n_embd=64)).save_pretrained"
    command = [sys.executable, "-c", f"{make}({str(folder)!r})"]
    return shared_cell(shared_folder, "hf folder made", command, "done", out_dir=str(folder))


@pytest.fixture(scope="session")
def exported(shared_folder, base_model) -> dict:
    folder = shared_folder / "hf-export"
    command = [sys.executable, "-m", "weights", "hf", str(Path(passed(base_model)["out_dir"]) / "ckpt.pt"), str(folder)]
    return shared_cell(shared_folder, "export -> transformers loads it", command, "done", out_dir=str(folder))


@pytest.fixture(scope="session")
def gpt2_folder(shared_folder) -> dict:
    """GPT-2 124M with random weights, as a Hugging Face folder: the speed cells' model."""
    folder = shared_folder / "hf-gpt2-124M"
    make = f"import transformers as t; t.GPT2LMHeadModel(t.GPT2Config()).save_pretrained({str(folder)!r})"
    command = [sys.executable, "-c", make]
    return shared_cell(shared_folder, "speed: GPT-2 124M folder", command, "done", out_dir=str(folder))


def test_base_model(base_model, record_property):
    report(base_model, record_property)


# ----------------------------------------------------------------------------------------------
# train.py per backend


def train_cell(shared_folder: Path, data: Path, backend: str, packed: bool, compiled: bool) -> dict:
    name = f"train {backend} {'packed' if packed else 'plain'} {'compiled' if compiled else 'eager'}"
    settings = [*MODEL, *TRAIN, f"--attention_backend={backend}", f"--compile={str(compiled).lower()}"]
    settings.append("--dtype=bfloat16")
    if packed:  # a line a document
        newline = json.loads((data / "meta.json").read_text())["itos"].index("\n")
        settings += ["--packed_documents=true", f"--document_separator={newline}"]
    command = train_command(data, shared_folder / re.sub(r"\W+", "-", name), *settings)
    return once(shared_folder, name, lambda: {**run_cell(command, "train", backend), "name": name})


def why_backend_cannot_train(backend: str, packed: bool) -> str:
    import torch

    import kernels  # noqa: F401  (registers flash-attn 3/4 and flex_attention)
    from model import BACKENDS, AttentionUse

    use = AttentionUse(torch.device("cuda"), torch.bfloat16, head_dim=32, documents=packed)
    return BACKENDS[backend].why_not(use)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize(
    "backend", [pytest.param(b, marks=needs(packages=FLASH_PACKAGES.get(b, ())), id=b) for b in BACKENDS]
)
def test_train(backend, packed, compiled, shared_folder, corpus, record_property):
    why = why_backend_cannot_train(backend, packed)
    if why:
        pytest.skip(f"{backend}: {why}")
    outcome = train_cell(shared_folder, corpus, backend, packed, compiled)
    reference = train_cell(shared_folder, corpus, "sdpa", packed, compiled)
    report(outcome, record_property)
    if reference["status"] == "ok":
        gap = abs(outcome["figure"] - reference["figure"])
        assert gap <= LOSS_NOISE, f"loss {outcome['figure']:.3f} vs sdpa's {reference['figure']:.3f}"


# ----------------------------------------------------------------------------------------------
# A resume; FP8 training and its resume


def test_resume_first_run(stopped_run, record_property):
    report(stopped_run, record_property)


def test_resume_after_a_stop(stopped_run, corpus, tmp_path, record_property):
    out = copy_of(passed(stopped_run)["out_dir"], tmp_path)
    settings = [*MODEL, "--eval_iters=4", "--dtype=bfloat16", "--max_iters=40", "--eval_interval=20"]
    report(run_cell(train_command(corpus, out, *settings, "--init_from=resume")), record_property)


def fp8_ran(outcome: dict) -> None:
    """FP8 matmuls ran: train.py's INFO line names the recipe and at least one converted linear, and no WARNING
    says it fell back to bf16."""
    assert "WARNING: fp8=" not in outcome["output"], outcome["tail"]
    converted = re.search(r"fp8: tensorwise scaling on (\d+) of \d+ linears", outcome["output"])
    assert converted and int(converted.group(1)) > 0, outcome["tail"]


def skip_without_fp8() -> None:
    import torch

    from training.fp8 import why_fp8_cannot_run

    why = why_fp8_cannot_run(torch.device("cuda"), torch.bfloat16, compiled=True, lora=False)
    if why:
        pytest.skip(why)


@needs(packages=("torchao",))
def test_train_fp8_tensorwise(fp8_run, record_property):
    report(fp8_run, record_property)
    fp8_ran(fp8_run)


@needs(packages=("torchao",))
@pytest.mark.parametrize("fp8", ["tensorwise", "off"])
def test_resume_an_fp8_run(fp8, fp8_run, corpus, tmp_path, record_property):
    """A run trained with FP8 resumes with it and without it: the checkpoint holds plain weights."""
    out = copy_of(passed(fp8_run)["out_dir"], tmp_path)
    settings = [*FP8_MODEL, *TRAIN, "--max_iters=60", "--eval_interval=20", "--dtype=bfloat16", "--compile=true"]
    outcome = run_cell(train_command(corpus, out, *settings, f"--fp8={fp8}", "--init_from=resume"))
    report(outcome, record_property)
    if fp8 != "off":
        fp8_ran(outcome)


# ----------------------------------------------------------------------------------------------
# sample.py


SAMPLE_CELLS = [  # (kv cache, compiled): compile captures the decode step over a cache
    (cache, compiled)
    for cache in ("none", "contiguous", "paged")
    for compiled in (False, True)
    if cache != "none" or not compiled
]


@pytest.mark.parametrize("batch", [1, 4], ids=["batch1", "batch4"])
@pytest.mark.parametrize("window, new_tokens", [("inside", 150), ("sliding", 600)], ids=["inside", "sliding"])
@pytest.mark.parametrize(
    "cache, compiled", SAMPLE_CELLS, ids=[f"{c}-{'compiled' if k else 'eager'}" for c, k in SAMPLE_CELLS]
)
def test_sample(cache, compiled, window, new_tokens, batch, base_model, tmp_path, record_property):
    """block_size is 256: `sliding` generates past it."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ROMEO:\nWhat light through yonder window breaks? It is the east\nA\nThe quick brown fox\n")
    start = ["--start=ROMEO:"] if batch == 1 else [f"--start=FILE:{prompts}", "--batch_size=4"]
    command = [sys.executable, "sample.py", f"--out_dir={passed(base_model)['out_dir']}"]
    command += [f"--max_new_tokens={new_tokens}", f"--kv_cache={cache}", f"--compile={str(compiled).lower()}"]
    report(run_cell([*command, "--num_samples=1", *start], "sample"), record_property)


# ----------------------------------------------------------------------------------------------
# Weights: LoRA, Hugging Face folders in and out


def test_lora_train(lora_run, record_property):
    report(lora_run, record_property)


def test_lora_sample(lora_run, record_property):
    command = [sys.executable, "sample.py", f"--out_dir={passed(lora_run)['out_dir']}", "--max_new_tokens=50"]
    report(run_cell([*command, "--dtype=bfloat16"], "sample"), record_property)


def test_lora_merge(lora_run, tmp_path, record_property):
    checkpoint = Path(passed(lora_run)["out_dir"]) / "ckpt.pt"
    command = [sys.executable, "-m", "weights", "merge", str(checkpoint), str(tmp_path / "merged.pt")]
    report(run_cell(command, "done"), record_property)


@needs(packages=("transformers",))
def test_hf_folder_made(hf_folder, record_property):
    report(hf_folder, record_property)


@needs(packages=("transformers",))
def test_hf_folder_in_then_sample(hf_folder, record_property):
    command = [sys.executable, "sample.py", f"--init_from={passed(hf_folder)['out_dir']}", "--max_new_tokens=50"]
    report(run_cell([*command, "--start=Hello"], "sample"), record_property)


def test_export_to_hf(exported, record_property):
    report(exported, record_property)


@needs(packages=("transformers",))
def test_transformers_loads_the_export(exported, record_property):
    load = f"import transformers as t; t.GPT2LMHeadModel.from_pretrained({passed(exported)['out_dir']!r})"
    report(run_cell([sys.executable, "-c", load], "done"), record_property)


# ----------------------------------------------------------------------------------------------
# torchrun on 2 GPUs


PARALLEL = {  # cell id: (model, train.py settings); DDP the default
    "ddp": (MODEL, []),
    "ddp-compile_blocks": (MODEL, ["--compile_blocks=true"]),
    "fsdp": (MODEL, ["--parallelism=fsdp"]),
    "ddp-shard_optimizer-profiled": (MODEL, ["--shard_optimizer=true", "--profile_steps=2"]),
    "context_parallel": (MODEL, ["--context_parallel=2"]),
    "context_parallel-block_recomputation": (MODEL, ["--context_parallel=2", "--activation_checkpointing=block"]),
    "ddp-fp8": (FP8_MODEL, ["--fp8=tensorwise", "--compile=true"]),
    "fsdp-fp8": (FP8_MODEL, ["--parallelism=fsdp", "--fp8=tensorwise", "--compile=true"]),
    "fsdp-fp8-accumulated-reduce_every_micro_step": (  # the 6.7B config's way: 2 micro-steps a rank
        FP8_MODEL,
        ["--parallelism=fsdp", "--fp8=tensorwise", "--compile=true", "--gradient_accumulation_steps=4"]
        + ["--fsdp_reduce_every_micro_step=true"],
    ),
}


def parallel_command(name: str, data: Path, out_dir: Path) -> list[str]:
    """The cell's torchrun command: gradient_accumulation_steps counts the micro-steps of all ranks together,
    as in nanoGPT, so 2 (unless the cell sets its own) gives each rank one."""
    model, settings = PARALLEL[name]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    train = ["train.py", f"--data_dir={data}", f"--out_dir={out_dir}", *model, *TRAIN, "--dtype=bfloat16"]
    return [*torchrun, *train, "--gradient_accumulation_steps=2", *settings]


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=needs(2, ("torchao",) if "fp8" in n else ()), id=n) for n in PARALLEL]
)
def test_torchrun_2_gpus(name, corpus, tmp_path, record_property):
    if "fp8" in name:
        skip_without_fp8()
    outcome = run_cell(parallel_command(name, corpus, tmp_path / name))
    report(outcome, record_property)
    if "fp8" in name:
        fp8_ran(outcome)


# ----------------------------------------------------------------------------------------------
# sample.py's decode speed as a user sees it, each cell with the GPU to itself: GPT-2 124M (random weights, a
# Hugging Face folder) at batch 1 by each way of decoding, and sliding past block_size (1024) with each slide; the
# char model (block_size 256) likewise


SAMPLE = [sys.executable, "sample.py", "--num_samples=1", "--start=Hello", "--temperature=0.8"]
GPT2_SPEED = {
    "default-cuda_graph": ["--max_new_tokens=500"],
    "eager": ["--max_new_tokens=500", "--cuda_graph=false"],
    "compiled": ["--max_new_tokens=500", "--compile=true"],
    "sliding-half": ["--max_new_tokens=2000", "--slide=half"],
    "sliding-exact": ["--max_new_tokens=2000", "--slide=exact"],
}
CHAR_SPEED = {
    "inside": ["--max_new_tokens=200"],
    "half": ["--max_new_tokens=1000", "--slide=half"],
    "exact": ["--max_new_tokens=1000", "--slide=exact"],
}


@needs(packages=("transformers",))
def test_speed_gpt2_folder(gpt2_folder, record_property):
    report(gpt2_folder, record_property)


@needs(packages=("transformers",))
@pytest.mark.parametrize("name", list(GPT2_SPEED))
def test_speed_gpt2(name, gpt2_folder, alone, record_property):
    command = [*SAMPLE, f"--init_from={passed(gpt2_folder)['out_dir']}", *GPT2_SPEED[name]]
    report(run_cell(command, "sample"), record_property)


@pytest.mark.parametrize("name", list(CHAR_SPEED))
def test_speed_char(name, base_model, alone, record_property):
    command = [*SAMPLE, f"--out_dir={passed(base_model)['out_dir']}", *CHAR_SPEED[name]]
    report(run_cell(command, "sample"), record_property)
