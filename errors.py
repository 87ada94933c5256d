"""Every error type of this repo. Each one's message is one line: what was wrong and what is allowed or what
to do; the entry points print it after `error: ` and exit with code 2."""


class OneLineError(ValueError):
    """An error whose message is always one line (a multi-line cause is joined)."""

    def __init__(self, message: str = ""):
        super().__init__(" ".join(str(message).splitlines()))


class ConfigError(OneLineError):
    """A bad config file or --key=value override."""


class UsageError(ValueError):
    """Bad input found after the config was read (device, data, checkpoint)."""


class DataError(ValueError):
    """A dataset is missing or broken; the message names the problem and the fix."""


class CheckpointError(ValueError):
    """A missing, unreadable or mismatched checkpoint, or an out_dir that cannot be used."""
