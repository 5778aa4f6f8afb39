"""The configuration's error, apart from protocol.config so that the modules its checks live in (protocol.access)
can raise it without importing the config."""


class ConfigError(ValueError):
    """A user mistake in the configuration; the message names the key."""


class SinkError(Exception):
    """The Kafka result sink (master.sink) could not deliver: the broker unreachable or refusing rows within
    output.kafka.timeout, or Kafka holding rows a recovery would send again."""
