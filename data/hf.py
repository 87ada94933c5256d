"""Prepare a Hugging Face text dataset (OpenWebText, FineWeb, ...) as GPT-2 tokens, like nanoGPT's openwebtext.

Documents are tokenized in parallel with dataset.map, each followed by <|endoftext|>, then copied shard by shard
into a np.memmap of the final size, so the corpus never has to fit in RAM.
"""

import argparse
import os
import socket
import time
import urllib.parse
from pathlib import Path

import datasets
import httpx
import huggingface_hub
import numpy as np
from tqdm import tqdm

from data.common import DTYPE, OneLineParser, check_split_sizes, make_out_dir, write_meta
from data.files import commit_dataset, staged_bins
from data.tokenizer import EOT_ID, gpt2_encoding, gpt2_meta
from errors import DataError

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
SPLIT_SEED = 2357  # nanoGPT's seed, so the val documents are the same on every run
FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
# uint16 ids in the map cache take a quarter of the disk that the default int64 would.
TOKENIZED_FEATURES = datasets.Features({"ids": datasets.List(datasets.Value("uint16")), "len": datasets.Value("int64")})


def load_local_dataset(path: Path, num_proc: int):
    """A datasets.Dataset from a save_to_disk folder, or from json/jsonl/parquet/txt files (a file or a folder)."""
    if not path.exists():
        raise DataError(f"--dataset_path {path} does not exist")
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded and len(loaded) != 1:
                raise DataError(f"--dataset_path {path} has splits {list(loaded)} but no 'train' split")
            loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
        return loaded
    files = sorted(p for p in path.iterdir() if p.suffix in FILE_FORMATS) if path.is_dir() else [path]
    formats = {FILE_FORMATS.get(p.suffix) for p in files}
    if not files or None in formats or len(formats) > 1:
        raise DataError(
            f"--dataset_path {path}: expected a save_to_disk folder or .json/.jsonl/.parquet/.txt files of one kind"
        )
    return datasets.load_dataset(formats.pop(), data_files=[str(p) for p in files], split="train", num_proc=num_proc)


def load_text_dataset(dataset_path: Path | None, hf_name: str, hf_config: str | None, num_proc: int):
    if dataset_path is not None:
        return load_local_dataset(dataset_path, num_proc)
    offline = "pass --dataset_path with a local copy, or set HF_HUB_OFFLINE=1 to use what the Hugging Face cache holds"
    unreachable = hub_unreachable()
    if unreachable:
        raise DataError(f"cannot download {hf_name}: the Hugging Face hub is unreachable ({unreachable}); {offline}")
    try:
        return datasets.load_dataset(hf_name, name=hf_config, split="train", num_proc=num_proc)
    except (ConnectionError, httpx.HTTPError) as e:  # huggingface_hub's OfflineModeIsEnabled is a ConnectionError
        reason = " ".join(str(e).split()) or type(e).__name__  # datasets: "Couldn't reach 'NAME' on the Hub (...)"
        raise DataError(f"cannot download {hf_name} ({reason}); check the network, or {offline}") from None
    except RuntimeError as e:
        if "scripts are no longer supported" not in str(e):
            raise
        # Happened to Skylion007/openwebtext in 2025 (nanoGPT issue #633) until its script was converted.
        raise DataError(
            f"{hf_name} on the hub still needs a loading script, which datasets>=4 refuses; "
            f"pip install 'datasets<4' or pass --dataset_path"
        ) from e


def hub_unreachable() -> str:
    """Why the hub's host cannot be reached, found at once ('' when it may be): a name that does not resolve fails
    each of huggingface_hub's retries alike, half a minute of warnings before the error. Not checked offline
    (HF_HUB_OFFLINE: the cache answers) or behind a proxy (the proxy resolves names)."""
    if huggingface_hub.constants.HF_HUB_OFFLINE or any(os.environ.get(name) for name in PROXY_VARIABLES):
        return ""
    host = urllib.parse.urlparse(huggingface_hub.constants.ENDPOINT).hostname or ""
    try:
        socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return f"{host}: {getattr(e, 'strerror', None) or e}"
    return ""


def tokenize_documents(batch: dict, text_column: str) -> dict:
    """dataset.map function: GPT-2 ids of each document with EOT appended, and their lengths."""
    ids = gpt2_encoding().encode_ordinary_batch(batch[text_column])
    for document in ids:
        document.append(EOT_ID)  # separates documents; text that merely contains "<|endoftext|>" stays text
    return {"ids": ids, "len": [len(document) for document in ids]}


def write_tokens(path: Path, tokenized, max_shards: int = 1024, name: str = "") -> tuple[int, int]:
    """Concatenate the `ids` of every row into path as uint16, in contiguous shards; return (token count,
    largest id), the largest for meta.json so that readers need not scan the whole file for it."""
    total = token_count(tokenized)
    num_shards = min(max_shards, len(tokenized))
    largest = -1
    tokens = np.memmap(path, dtype=DTYPE, mode="w+", shape=(total,))
    position = 0
    for index in tqdm(range(num_shards), desc=f"writing {name or path.name}"):
        shard = tokenized.shard(num_shards, index, contiguous=True).with_format("numpy")
        ids = np.concatenate(shard[:]["ids"])
        tokens[position : position + len(ids)] = ids
        position += len(ids)
        largest = max(largest, int(ids.max())) if len(ids) else largest
    tokens.flush()
    del tokens  # unmapped before the commit fsyncs and renames the file
    return total, largest


def token_count(tokenized) -> int:
    return int(np.sum(tokenized.with_format("numpy")[:]["len"], dtype=np.int64))


def prepare_hf_dataset(
    out_dir: Path,
    dataset_path: Path | None = None,
    hf_name: str = "",
    hf_config: str | None = None,
    val_size: int | None = None,
    val_fraction: float = 0.0005,
    num_proc: int = 1,
    text_column: str = "text",
) -> dict:
    """Load, split off a small seeded val set, tokenize, and write out_dir/{train.bin,val.bin,meta.json}."""
    if val_size is None and not 0 < val_fraction < 1:
        raise DataError(f"--val_fraction must be between 0 and 1, got {val_fraction}")
    dataset = load_text_dataset(dataset_path, hf_name, hf_config, num_proc)
    if text_column not in dataset.column_names:
        raise DataError(f"dataset has no column {text_column!r} (columns: {dataset.column_names}); use --text_column")
    if len(dataset) < 2:
        raise DataError(f"dataset has {len(dataset)} documents, need at least 2 to split off a val set")
    num_val = val_size if val_size is not None else max(1, round(len(dataset) * val_fraction))
    if not 0 < num_val < len(dataset):
        raise DataError(f"val set of {num_val} documents out of {len(dataset)} leaves no train or no val set")
    splits = dataset.train_test_split(test_size=num_val, seed=SPLIT_SEED, shuffle=True)
    tokenized = splits.map(
        tokenize_documents,
        batched=True,
        fn_kwargs={"text_column": text_column},
        remove_columns=dataset.column_names,
        features=TOKENIZED_FEATURES,
        num_proc=num_proc,
        desc="tokenizing",
    )
    source = str(dataset_path) if dataset_path is not None else f"{hf_name} ({hf_config or 'default'})"
    check_split_sizes({"train": token_count(tokenized["train"]), "val": token_count(tokenized["test"])}, source)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"dataset": out_dir.name, "source": source, **gpt2_meta()}
    meta |= {"train_documents": len(splits["train"]), "val_documents": len(splits["test"])}
    with staged_bins(out_dir) as staged:  # committed as a whole: see data/files.py
        for name, split in (("train", "train"), ("val", "test")):
            meta[f"{name}_tokens"], meta[f"{name}_max_id"] = write_tokens(
                staged[name], tokenized[split], name=f"{name}.bin"
            )
        return commit_dataset(out_dir, staged, lambda: write_meta(out_dir, meta))


def hf_prepare_main(
    argv: list[str] | None, default_out_dir: Path, hf_name: str, hf_config: str | None, description: str
) -> dict:
    """CLI shared by the Hugging Face datasets; each prepare.py only supplies its defaults."""
    parser = OneLineParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dataset_path",
        type=Path,
        help="local data instead of the hub: a save_to_disk folder, or json/jsonl/parquet/txt files",
    )
    parser.add_argument("--hf_name", default=hf_name, help="hub dataset (default: %(default)s)")
    parser.add_argument("--hf_config", default=hf_config, help="hub dataset config (default: %(default)s)")
    parser.add_argument("--text_column", default="text", help="column holding the documents (default: %(default)s)")
    parser.add_argument("--out_dir", type=Path, default=default_out_dir, help="where to write (default: %(default)s)")
    val = parser.add_mutually_exclusive_group()
    val.add_argument(
        "--val_fraction",
        type=float,
        default=0.0005,
        help="fraction of documents held out for validation (default: %(default)s)",
    )
    val.add_argument("--val_size", type=int, help="number of documents held out for validation")
    parser.add_argument(
        "--num_proc",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="worker processes for loading and tokenizing (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    make_out_dir(args.out_dir)
    meta = prepare_hf_dataset(
        args.out_dir,
        args.dataset_path,
        args.hf_name,
        args.hf_config,
        args.val_size,
        args.val_fraction,
        args.num_proc,
        args.text_column,
    )
    print(
        f"{meta['source']}: {meta['train_documents']:,} + {meta['val_documents']:,} documents | "
        f"train {meta['train_tokens']:,} tokens | val {meta['val_tokens']:,} tokens | "
        f"wrote {args.out_dir}/{{train.bin,val.bin,meta.json}} in {time.perf_counter() - started:.1f}s"
    )
    return meta
