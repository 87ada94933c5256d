from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal

import pytest

import configurator
from configurator import format_help, load_config, parse_bool
from errors import ConfigError


@dataclass
class Cfg:
    # ---- io ----
    out_dir: str = "out"  # where checkpoints go
    init_from: str = "scratch"  # scratch or resume
    log_prefix: str = "# "  # printed before every log line
    # ---- model ----
    n_layer: int = 12  # number of transformer blocks
    dropout: float = 0.0  # dropout probability
    learning_rate: float = 6e-4  # max learning rate
    compile: bool = True  # torch.compile the model
    seed: int | None = None  # None picks a random seed
    wandb_run_name: str | None = None  # wandb run name, None for automatic
    attention_backend: Literal["manual", "sdpa", "flash_attn_2"] = "sdpa"  # attention kernel

    def __post_init__(self):
        if self.n_layer < 0:
            raise ValueError(f"n_layer must be >= 0, got {self.n_layer}")


DEPRECATED = {
    "use_flash_attention": (
        "attention_backend",
        lambda v: "flash_attn_2" if (parse_bool(v) if isinstance(v, str) else bool(v)) else "manual",
    )
}


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def config_error(argv, deprecated=None, defaults=None):
    with pytest.raises(ConfigError) as info:
        load_config(defaults or Cfg(), argv, deprecated)
    return str(info.value)


# ---- config files ----


def test_no_arguments_returns_an_equal_new_instance():
    defaults = Cfg()
    config = load_config(defaults, [])
    assert config == defaults and config is not defaults


def test_file_assignments_are_applied(tmp_path):
    path = write(
        tmp_path,
        "c.py",
        "n_layer = 4\nlearning_rate = 1e-3\ncompile = False\nseed = 7\n"
        'attention_backend = "manual"\ninit_from = "resume"\n',
    )
    config = load_config(Cfg(), [path])
    assert (config.n_layer, config.learning_rate, config.compile) == (4, 1e-3, False)
    assert (config.seed, config.attention_backend, config.init_from) == (7, "manual", "resume")


def test_file_unknown_name_suggests_the_closest_field(tmp_path):
    path = write(tmp_path, "c.py", "n_layr = 4\n")
    assert config_error([path]) == f"{path}: unknown config key 'n_layr'; did you mean: n_layer?"


def test_file_helpers_imports_and_underscore_names_are_allowed(tmp_path):
    path = write(tmp_path, "c.py", "import math\n_blocks = 3\nn_layer = int(math.sqrt(16)) + _blocks\n")
    assert load_config(Cfg(), [path]).n_layer == 7


def test_file_other_new_names_are_errors(tmp_path):
    path = write(tmp_path, "c.py", "def helper():\n    return 1\n")
    assert config_error([path]) == f"{path}: unknown config key 'helper'; see --help for all keys"


def test_file_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "c.py", "n_layer = 4\ndropout = = 0.1\n")
    assert config_error([path]) == f"{path}: syntax error on line 2: invalid syntax"


def test_file_that_raises_names_file_line_and_error(tmp_path):
    path = write(tmp_path, "c.py", "n_layer = 4\ndropout = 1 / 0\n")
    assert config_error([path]) == f"{path}: ZeroDivisionError on line 2: division by zero"


def test_missing_and_non_python_files(tmp_path):
    missing = str(tmp_path / "nope.py")
    assert config_error([missing]) == f"config file '{missing}' not found"
    assert config_error(["c.txt"]) == "config file 'c.txt' is not a .py file; overrides must be --key=value"


@pytest.mark.parametrize(
    "line, message",
    [
        ('n_layer = "12"', "n_layer='12': expected int"),
        ("n_layer = 1.5", "n_layer=1.5: expected int"),
        ("n_layer = True", "n_layer=True: expected int"),
        ("compile = 1", "compile=1: expected bool"),
        ("learning_rate = '1e-3'", "learning_rate='1e-3': expected float"),
        ("seed = 'x'", "seed='x': expected int | None"),
        ("attention_backend = 'flash'", "attention_backend='flash': expected one of manual|sdpa|flash_attn_2"),
    ],
)
def test_file_values_are_type_checked(tmp_path, line, message):
    path = write(tmp_path, "c.py", line + "\n")
    assert config_error([path]) == f"{path}: {message}"


def test_file_int_for_float_and_none_for_optional(tmp_path):
    path = write(tmp_path, "c.py", "learning_rate = 1\nseed = None\nwandb_run_name = 'run1'\n")
    config = load_config(Cfg(seed=3), [path])
    assert config.learning_rate == 1.0 and type(config.learning_rate) is float
    assert (config.seed, config.wandb_run_name) == (None, "run1")


def test_later_file_overrides_earlier(tmp_path):
    first = write(tmp_path, "a.py", "n_layer = 4\ndropout = 0.1\n")
    second = write(tmp_path, "b.py", "n_layer = 6\n")
    config = load_config(Cfg(), [first, second])
    assert (config.n_layer, config.dropout) == (6, 0.1)


def test_overrides_apply_after_all_files_in_order(tmp_path):
    path = write(tmp_path, "a.py", "n_layer = 4\ndropout = 0.1\n")
    config = load_config(Cfg(), ["--n_layer=8", path, "--dropout=0.2", "--dropout=0.3"])
    assert (config.n_layer, config.dropout) == (8, 0.3)


def test_files_do_not_share_a_namespace(tmp_path):
    first = write(tmp_path, "a.py", "_depth = 5\n")
    second = write(tmp_path, "b.py", "n_layer = _depth\n")
    assert config_error([first, second]) == f"{second}: NameError on line 1: name '_depth' is not defined"


# ---- --key=value overrides ----


@pytest.mark.parametrize(
    "text, expected",
    [
        ("true", True),
        ("TRUE", True),
        ("1", True),
        ("yes", True),
        ("Yes", True),
        ("on", True),
        ("ON", True),
        ("false", False),
        ("False", False),
        ("0", False),
        ("no", False),
        ("NO", False),
        ("off", False),
        ("Off", False),
    ],
)
def test_bool_spellings(text, expected):
    assert parse_bool(text) is expected
    assert load_config(Cfg(compile=not expected), [f"--compile={text}"]).compile is expected


def test_bool_rejects_other_words():
    with pytest.raises(ValueError, match=r"^expected bool \(true/false/1/0/yes/no/on/off\), got 'maybe'$"):
        parse_bool("maybe")
    assert config_error(["--compile=maybe"]) == "--compile=maybe: expected bool (true/false/1/0/yes/no/on/off)"


def test_bare_flag_means_true_for_bools_only():
    assert load_config(Cfg(compile=False), ["--compile"]).compile is True
    assert config_error(["--n_layer"]) == "--n_layer needs a value: use --n_layer=VALUE or --n_layer VALUE"
    assert config_error(["--n_layer", "--compile"]) == "--n_layer needs a value: use --n_layer=VALUE or --n_layer VALUE"


def test_numbers():
    config = load_config(Cfg(), ["--learning_rate=1", "--dropout=6e-4", "--n_layer=1_000"])
    assert config.learning_rate == 1.0 and type(config.learning_rate) is float
    assert (config.dropout, config.n_layer) == (0.0006, 1000)
    assert config_error(["--n_layer=1.5"]) == "--n_layer=1.5: expected int"
    assert config_error(["--learning_rate=abc"]) == "--learning_rate=abc: expected float"


def test_value_is_split_on_the_first_equals_only():
    config = load_config(Cfg(), ["--init_from=a=b", "--out_dir="])
    assert (config.init_from, config.out_dir) == ("a=b", "")


def test_optional_fields_take_none():
    assert load_config(Cfg(seed=1), ["--seed=None"]).seed is None
    assert load_config(Cfg(seed=1), ["--seed=none"]).seed is None
    assert load_config(Cfg(), ["--seed=42"]).seed == 42
    assert load_config(Cfg(), ["--wandb_run_name=run1"]).wandb_run_name == "run1"
    assert config_error(["--seed=x"]) == "--seed=x: expected int | None"


def test_literal_accepts_only_listed_values():
    assert load_config(Cfg(), ["--attention_backend=manual"]).attention_backend == "manual"
    assert (
        config_error(["--attention_backend=flash"])
        == "--attention_backend=flash: expected one of manual|sdpa|flash_attn_2"
    )


def test_unknown_key_suggests_close_names_or_help():
    assert config_error(["--n_layr=3"]) == "unknown config key 'n_layr'; did you mean: n_layer?"
    assert config_error(["--zzzz=3"]) == "unknown config key 'zzzz'; see --help for all keys"


def test_stray_arguments_are_rejected():
    assert (
        config_error(["-n_layer=3"])
        == "unexpected argument '-n_layer=3'; use .py config files and --key=value overrides"
    )


def test_config_error_is_one_line_value_error():
    assert str(ConfigError("first\nsecond")) == "first second"
    assert issubclass(ConfigError, ValueError)


# ---- deprecated keys ----


def test_deprecated_override_maps_to_new_key_and_warns():
    message = "'use_flash_attention' is deprecated; use attention_backend='flash_attn_2'"
    with pytest.warns(DeprecationWarning, match=f"^{re.escape(message)}$") as record:
        config = load_config(Cfg(), ["--use_flash_attention=yes"], DEPRECATED)
    assert config.attention_backend == "flash_attn_2"
    assert [w.filename for w in record] == [__file__]  # points at the caller, so it is shown by default


def test_deprecated_key_in_file_gets_the_python_value(tmp_path):
    path = write(tmp_path, "c.py", "use_flash_attention = False\n")
    with pytest.warns(
        DeprecationWarning, match="^'use_flash_attention' is deprecated; use attention_backend='manual'$"
    ):
        assert load_config(Cfg(), [path], DEPRECATED).attention_backend == "manual"


def test_deprecated_bad_value_is_a_config_error():
    assert (
        config_error(["--use_flash_attention=maybe"], DEPRECATED)
        == "--use_flash_attention=maybe: expected bool (true/false/1/0/yes/no/on/off), got 'maybe'"
    )


# ---- validation, help, no side effects ----


def test_post_init_value_error_becomes_config_error():
    assert config_error(["--n_layer=-1"]) == "n_layer must be >= 0, got -1"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_every_field_and_exits_zero(capsys, flag):
    with pytest.raises(SystemExit) as info:
        load_config(Cfg(), ["missing.py", "--n_layer=3", flag])  # help wins over later errors
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out == format_help(Cfg()) + "\n"
    assert out.startswith("usage: train.py [config.py ...] [--key=value ...]\n")
    rows = [line for line in out.splitlines() if line.startswith("  --")]
    assert [re.split(r"\s{2,}", row.strip()) for row in rows] == [
        ["--out_dir=out", "(str)", "where checkpoints go"],
        ["--init_from=scratch", "(str)", "scratch or resume"],
        ["--log_prefix='# '", "(str)", "printed before every log line"],
        ["--n_layer=12", "(int)", "number of transformer blocks"],
        ["--dropout=0.0", "(float)", "dropout probability"],
        ["--learning_rate=0.0006", "(float)", "max learning rate"],
        ["--compile=True", "(bool)", "torch.compile the model"],
        ["--seed=None", "(int | None)", "None picks a random seed"],
        ["--wandb_run_name=None", "(str | None)", "wandb run name, None for automatic"],
        ["--attention_backend=sdpa", "(manual|sdpa|flash_attn_2)", "attention kernel"],
    ]
    assert len({row.index("(") for row in rows}) == 1  # aligned type column
    assert "\nio:\n" in out and "\nmodel:\n" in out


def test_explicit_keys_are_the_fields_set_even_to_their_defaults(tmp_path):
    """What the files and overrides set, under the field's own name (an alias or a deprecated key counts as the
    field it sets), a default value included; the defaults left alone are not among them."""
    path = write(tmp_path, "c.py", "n_layer = 12\n")  # Cfg's default, set
    argv = [path, "--dropout=0.5", "--attn_implementation=manual", "--use_flash_attention=no"]
    with pytest.warns(DeprecationWarning) as record:
        config, explicit = configurator.load_config_and_explicit_keys(Cfg(), argv, DEPRECATED)
    assert config == Cfg(dropout=0.5, attention_backend="manual")
    assert explicit == {"n_layer", "dropout", "attention_backend"}
    assert [w.filename for w in record] == [__file__]  # the warning points at the caller, as load_config's
    assert configurator.load_config_and_explicit_keys(Cfg(), []) == (Cfg(), frozenset())


def test_defaults_object_is_not_mutated(tmp_path):
    defaults = Cfg()
    path = write(tmp_path, "c.py", "n_layer = 2\ncompile = False\n")
    config = load_config(defaults, [path, "--dropout=0.5"], DEPRECATED)
    assert (config.n_layer, config.compile, config.dropout) == (2, False, 0.5)
    assert dataclasses.asdict(defaults) == dataclasses.asdict(Cfg())


def test_config_files_do_not_touch_configurator_globals(tmp_path):
    before = dict(vars(configurator))
    path = write(
        tmp_path, "c.py", "import os\n_leak = 1\n__name__ = 'hijacked'\nparse_bool = None\nConfigError = None\n"
    )
    with pytest.raises(ConfigError):  # parse_bool / ConfigError are not fields of Cfg
        load_config(Cfg(), [path])
    ok = write(tmp_path, "ok.py", "import os\n_leak = 1\n__name__ = 'hijacked'\nn_layer = 3\n")
    assert load_config(Cfg(), [ok]).n_layer == 3
    after = vars(configurator)
    assert after.keys() == before.keys()
    assert all(after[name] is value for name, value in before.items())
    assert "_leak" not in after and "n_layer" not in after and configurator.__name__ == "configurator"


# ---- the guides' flag names and forms ----


def test_key_space_value_form(tmp_path):
    path = write(tmp_path, "c.py", "n_layer = 2\n")
    config = load_config(Cfg(), ["--n_layer", "3", "--out_dir", "x y", "--dropout", "0.5", "--seed", "-1"])
    assert (config.n_layer, config.out_dir, config.dropout, config.seed) == (3, "x y", 0.5, -1)
    # a bool takes the next word only if it is a bool word: a config file after --compile is still a file
    assert load_config(Cfg(), ["--compile", "false"]).compile is False
    config = load_config(Cfg(compile=False), ["--compile", path, "--init_from", "resume"])
    assert (config.compile, config.n_layer, config.init_from) == (True, 2, "resume")


def test_attn_implementation_is_attention_backend():
    assert load_config(Cfg(), ["--attn_implementation=manual"]).attention_backend == "manual"
    assert load_config(Cfg(), ["--attn_implementation", "flash_attn_2"]).attention_backend == "flash_attn_2"
    assert "--attn_implementation is another name for --attention_backend." in format_help(Cfg())


@pytest.mark.parametrize(
    "value, canonical",
    [
        ("eager", "manual"),
        ("sdpa", "sdpa"),
        ("flash_attention_2", "flash_attn_2"),
        ("flash_attention_3", "flash_attn_3"),
        ("flex_attention", "flex_attention"),
        ("paged_attention", "paged_attention"),
        ("auto", "auto"),
    ],
)
def test_guide_attention_names_reach_the_model(value, canonical):
    from train import TrainConfig

    config = load_config(TrainConfig(), [f"--attn_implementation={value}"])
    assert config.model_config().attention_backend == canonical


def test_guide_names_suggest_ours_with_their_meaning():
    from sample import SampleConfig
    from train import TrainConfig

    cases = {
        "--max_steps=100": "unknown setting --max_steps; did you mean --max_iters (optimizer steps in total)?",
        "--max_length=512": "unknown setting --max_length; did you mean --block_size (context length in tokens)?",
        "--fp16": "unknown setting --fp16; did you mean --dtype=float16 (float16 mixed precision)?",
        "--eval_steps=10": (
            "unknown setting --eval_steps; did you mean --eval_interval (evaluate every this many iterations)?"
        ),
    }
    for arg, message in cases.items():
        assert config_error([arg], defaults=TrainConfig()) == message
    assert config_error(["--max_steps", "100"], defaults=TrainConfig()) == cases["--max_steps=100"]
    assert load_config(SampleConfig(), ["--attn_implementation", "eager"]).attention_backend == "manual"
    assert config_error(["--max_length=64"], defaults=SampleConfig()) == (
        "unknown setting --max_length; did you mean --max_new_tokens (tokens generated per sample, not counting "
        "the prompt)?"
    )
