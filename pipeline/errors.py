"""Error types the CLI maps to exit codes: bad input exits 2, anything else at run time exits 1."""


class InvalidInputError(ValueError):
    """The user's input (config, path, dataset, search space) is wrong; nothing was started."""


class ConfigError(InvalidInputError):
    """The experiment config failed validation; the message names each offending key and value."""
