"""Fill a config dataclass from Python config files and --key=value overrides.

    python train.py config/train_shakespeare_char.py --batch_size=32 --learning_rate=1e-3
    python train.py --batch_size 32 --compile          # --key value works too; a bare bool flag means true

Positional arguments are config files: plain Python assignments, run in a fresh namespace of their own
(never in this module's globals), applied in order. Then every --key=value override is applied in order.
`--key value` is the same as `--key=value`, except for bools: `--flag` alone is true, and the word after it
is its value only if it is a bool word (true/false/...), so `--compile config.py` still reads config.py.
Every value is checked against the field's declared type, so `--learning_rate=1` is 1.0 and
`--max_iters=1.5` is an error instead of a surprise. Range checks belong to the dataclass's __post_init__.
Names from Hugging Face guides: --attn_implementation is attention_backend; for others (--max_steps, ...) an
unknown-setting error names ours and what it means.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import io
import re
import tokenize
import traceback
import types
import typing
import warnings
from pathlib import Path

from errors import ConfigError

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_BOOL_FORMS = "/".join(t + "/" + f for t, f in zip(_TRUE, _FALSE))  # true/false/1/0/yes/no/on/off
_SECTION = re.compile(r"#\s*-{2,}\s*(.*?)\s*-*\s*$")  # a standalone `# ---- data ----` line

ALIASES = {"attn_implementation": "attention_backend"}  # other names for a field, e.g. the guides' (same values)
# Names the guides use -> (ours, what it means); the first whose field the config has is suggested
GUIDE_NAMES = {
    "max_steps": [("max_iters", "optimizer steps in total")],
    "max_length": [
        ("block_size", "context length in tokens"),
        ("max_new_tokens", "tokens generated per sample, not counting the prompt"),
    ],
    "fp16": [("dtype=float16", "float16 mixed precision")],
    "bf16": [("dtype=bfloat16", "bfloat16 mixed precision")],
    "eval_steps": [("eval_interval", "evaluate every this many iterations")],
    "warmup_steps": [("warmup_iters", "linear warmup steps")],
    "logging_steps": [("log_interval", "one log line every this many iterations")],
    "output_dir": [("out_dir", "where checkpoints go")],
    "per_device_train_batch_size": [("batch_size", "sequences per micro-step on each rank")],
}


def parse_bool(text: str) -> bool:
    """true/false/1/0/yes/no/on/off in any case; anything else is a ValueError."""
    word = text.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(f"expected bool ({_BOOL_FORMS}), got {text!r}")


def load_config(defaults, argv: list[str], deprecated: dict | None = None, prog: str = "train.py"):
    """Return a new dataclass instance: `defaults` filled from the config files, then the --key=value
    overrides in argv (argv excludes the program name). `deprecated` maps an old key to
    (new_key, convert); convert gets the raw value and returns the new key's value. `prog`: --help's name."""
    config, _, notices = _load(defaults, argv, deprecated, prog)
    _warn(notices)
    return config


def load_config_and_explicit_keys(defaults, argv: list[str], deprecated: dict | None = None, prog: str = "train.py"):
    """load_config's instance, and the frozenset of the fields that the config files and overrides set (an alias
    or a deprecated key counts as the field it sets): a value the user chose, even one equal to its default, is
    told apart from a default (train.py: a checkpoint's shape fills only the model settings the user left out)."""
    config, explicit, notices = _load(defaults, argv, deprecated, prog)
    _warn(notices)
    return config, explicit


def _warn(notices: list[str]) -> None:
    for message in notices:  # stacklevel 3: the line that called load_config, so Python shows it by default
        warnings.warn(message, DeprecationWarning, stacklevel=3)


def _load(defaults, argv: list[str], deprecated: dict | None, prog: str) -> tuple[object, frozenset[str], list[str]]:
    """(the filled instance, the fields set, the deprecation notices to warn of)."""
    if not dataclasses.is_dataclass(defaults) or isinstance(defaults, type):
        raise TypeError(f"defaults must be a dataclass instance, got {defaults!r}")
    if "-h" in argv or "--help" in argv:
        print(format_help(defaults, prog))
        raise SystemExit(0)
    deprecated = deprecated or {}
    types_ = _field_types(defaults)
    changes, notices = {}, []  # notices: deprecation messages, warned by the caller of _load

    def set_key(key, value, source, from_text):
        """Check one value and record it; source is the config file, or None for the command line."""
        where = f"{source}: {key}={value!r}" if source else f"--{key}={value}"
        if key in deprecated:
            new_key, convert = deprecated[key]
            try:
                value = convert(value)
            except ValueError as e:
                raise ConfigError(f"{where}: {e}") from None
            notices.append(f"'{key}' is deprecated; use {new_key}={value!r}")
            key, from_text = new_key, False
        key = ALIASES.get(key, key) if ALIASES.get(key) in types_ else key
        if key not in types_:
            raise ConfigError((f"{source}: " if source else "") + _unknown(key, [*types_, *deprecated]))
        try:
            changes[key] = _convert(value, types_[key], from_text)
        except ValueError:
            raise ConfigError(f"{where}: expected {_expected(types_[key], from_text)}") from None

    files, overrides = _split_argv(argv, {**types_, **{a: types_[k] for a, k in ALIASES.items() if k in types_}})
    # the whole command line is checked before any file runs
    for key, _ in overrides:
        if key not in types_ and key not in deprecated and ALIASES.get(key) not in types_:
            raise ConfigError(_unknown(key, [*types_, *deprecated]))
    for path in files:
        for key, value in _read_file(path).items():
            set_key(key, value, path, from_text=False)
    for key, text in overrides:
        set_key(key, text, None, from_text=True)

    try:
        return dataclasses.replace(defaults, **changes), frozenset(changes), notices
    except ValueError as e:  # the dataclass's own __post_init__ validation
        raise ConfigError(str(e)) from None


def format_help(defaults, prog: str = "train.py") -> str:
    """Usage line, then one aligned line per field: --name=default, (type), the field's `# comment`."""
    fields = _field_types(defaults)
    comments, sections = _source_comments(type(defaults), fields)
    options = {name: f"--{name}={_as_text(getattr(defaults, name))}" for name in fields}
    type_names = {name: f"({_type_name(tp)})" for name, tp in fields.items()}
    option_width = max(map(len, options.values()), default=0)
    type_width = max(map(len, type_names.values()), default=0)
    lines = [
        f"usage: {prog} [config.py ...] [--key=value ...]",
        "",
        "Config files (Python assignments) apply in order, then --key=value overrides.",
        f"Bools take {_BOOL_FORMS} (a bare --flag means true); Optional fields take None.",
        "--key value works as --key=value (a bool takes the next word only if it is one of those).",
    ]
    lines += [f"--{alias} is another name for --{key}." for alias, key in ALIASES.items() if key in fields]
    for i, name in enumerate(fields):
        if name in sections or i == 0:
            lines += ["", f"{sections.get(name, 'options')}:"]
        line = f"  {options[name]:<{option_width}}  {type_names[name]:<{type_width}}  {comments.get(name, '')}"
        lines.append(line.rstrip())
    return "\n".join(lines)


# ---- helpers ----


def _split_argv(argv: list[str], types_: dict) -> tuple[list[str], list[tuple[str, str]]]:
    """argv -> (config files, [(key, text), ...]); --key=value and --key value (see the module doc)."""
    files, overrides = [], []
    i = 0
    while i < len(argv):
        arg, following = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        i += 1
        if not arg.startswith("-"):
            files.append(arg)
            continue
        key, has_value, text = arg[2:].partition("=")  # split on the first `=` only: --x=a=b gives a=b
        if not arg.startswith("--") or not key:
            raise ConfigError(f"unexpected argument {arg!r}; use .py config files and --key=value overrides")
        if not has_value:
            takes_bool = key in types_ and _takes_bool(types_[key])
            if key not in types_ and following is not None and not following.startswith("--"):  # deprecated
                text, i = (following, i + 1) if not following.endswith(".py") else ("true", i)
            elif key not in types_:
                text = "true"
            elif takes_bool and following is not None and following.strip().lower() in _TRUE + _FALSE:
                text, i = following, i + 1
            elif takes_bool:
                text = "true"  # a bare --flag switches a bool on
            elif following is None or following.startswith("--"):
                raise ConfigError(f"{arg} needs a value: use --{key}=VALUE or --{key} VALUE")
            else:
                text, i = following, i + 1
        overrides.append((key, text))
    return files, overrides


def _field_types(defaults) -> dict:
    """{name: resolved type} for every field settable through __init__ (annotations may be strings)."""
    hints = typing.get_type_hints(type(defaults))
    return {f.name: hints[f.name] for f in dataclasses.fields(defaults) if f.init}


def _convert(value, tp, from_text: bool):
    """Return `value` as a `tp`, parsing it if it is command-line text; raise ValueError if it isn't one."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # Optional[X] and X | None
        if type(None) in args and (value is None or from_text and value.strip().lower() == "none"):
            return None
        for option in args:
            try:
                return _convert(value, option, from_text)
            except ValueError:
                pass
    elif origin is typing.Literal:
        for choice in args:
            if str(choice) == value if from_text else (type(value) is type(choice) and value == choice):
                return choice
    elif from_text and tp in (bool, int, float, str):
        return parse_bool(value) if tp is bool else tp(value)  # int() takes 1_000 and rejects 1.5
    elif tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif not from_text and isinstance(tp, type) and isinstance(value, tp):
        if not (tp is int and isinstance(value, bool)):  # True is an int to Python, not to a config
            return value
    raise ValueError(f"not a {tp}")


def _takes_bool(tp) -> bool:
    return tp is bool or bool in typing.get_args(tp)


def _type_name(tp) -> str:
    """Short name for --help: float, int | None, manual|sdpa."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return "|".join(str(c) for c in args)
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _expected(tp, from_text: bool) -> str:
    """What an error says was expected, with the accepted spellings where they are not obvious."""
    literal = typing.get_origin(tp) is typing.Literal
    bool_forms = f" ({_BOOL_FORMS})" if from_text and _takes_bool(tp) else ""
    return ("one of " if literal else "") + _type_name(tp) + bool_forms


def _unknown(key: str, known: list[str]) -> str:
    guide = [(ours, meaning) for ours, meaning in GUIDE_NAMES.get(key, []) if ours.split("=")[0] in known]
    if guide:
        ours, meaning = guide[0]
        return f"unknown setting --{key}; did you mean --{ours} ({meaning})?"
    close = difflib.get_close_matches(key, known, n=3)
    return f"unknown config key {key!r}; " + (
        f"did you mean: {', '.join(close)}?" if close else "see --help for all keys"
    )


def _read_file(path: str) -> dict:
    """Run one config file in a namespace of its own; return its public, non-module top-level names."""
    if not path.endswith(".py"):
        raise ConfigError(f"config file {path!r} is not a .py file; overrides must be --key=value")
    if not Path(path).is_file():
        raise ConfigError(f"config file {path!r} not found")
    namespace = {"__name__": "__config__", "__file__": path}
    try:
        exec(compile(Path(path).read_text(), path, "exec"), namespace)
    except SyntaxError as e:
        raise ConfigError(f"{path}: syntax error on line {e.lineno}: {e.msg}") from None
    except SystemExit as e:  # sys.exit(), exit(), quit(): a config file sets values, it cannot end the run
        code = "" if e.code is None else repr(e.code)
        raise ConfigError(
            f"{path}: {_file_line(e, path) or 'the file'} calls sys.exit({code}); a config file only assigns "
            f"settings and cannot end the run"
        ) from None
    except Exception as e:  # whatever the file raised, reported with its line
        line = _file_line(e, path)
        raise ConfigError(f"{path}: {type(e).__name__}{' on ' + line if line else ''}: {e}") from None
    return {
        name: value
        for name, value in namespace.items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }


def _file_line(error: BaseException, path: str) -> str:
    """'line N' of the config file where the error was raised ('' when its traceback has none)."""
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if frame.filename == path]
    return f"line {lines[-1]}" if lines else ""


def _source_comments(cls, fields) -> tuple[dict, dict]:
    """From the class source: {field: trailing `# comment`}, {field: title of a `# ---- title ----` above it}."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # class defined without a source file: help shows no comments
        return {}, {}
    # tokenize, not str.find("#"), so a `#` inside a string default is not taken for a comment
    comment_at = {
        t.start[0]: (t.start[1], t.string)
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT
    }
    comments, sections, title = {}, {}, None
    for row, line in enumerate(source.splitlines(), start=1):
        col, comment = comment_at.get(row, (len(line), ""))
        name = re.match(r"\s*(\w+)\s*:", line[:col])
        if name and name.group(1) in fields:
            comments[name.group(1)] = comment.lstrip("#").strip()
            if title:
                sections[name.group(1)], title = title, None
        elif not line[:col].strip() and _SECTION.match(comment):
            title = _SECTION.match(comment).group(1)
    return comments, sections


def _as_text(value) -> str:
    """A default as it would be typed on the command line; quoted where blanks would hide it."""
    needs_quotes = isinstance(value, str) and (value == "" or any(c.isspace() for c in value))
    return repr(value) if needs_quotes else str(value)
