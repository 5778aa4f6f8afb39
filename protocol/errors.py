"""The configuration's error, apart from protocol.config so that the modules its checks live in (protocol.access)
can raise it without importing the config."""


class ConfigError(ValueError):
    """A user mistake in the configuration; the message names the key."""
