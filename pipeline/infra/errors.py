"""The two exceptions every stage may raise. A leaf module: it imports nothing from the pipeline."""


class ConfigError(ValueError):
    """A user-facing configuration or input problem. The CLI prints it without a traceback and exits 2."""


class Skip(Exception):
    """A variant that cannot be built or run here (an impossible combination, a format the model does not
    allow); it is reported as skipped with this reason, never hidden, and the other variants still run."""
