"""The exceptions every stage may raise. A leaf module: it imports nothing from the pipeline."""


class ConfigError(ValueError):
    """A user-facing configuration or input problem. The CLI prints it without a traceback and exits 2."""


class Skip(Exception):
    """A variant that cannot be built or run here (an impossible combination, a format the model does not
    allow); it is reported as skipped with this reason, never hidden, and the other variants still run."""


# the exit codes of `quantdrift`: bad input or configuration; a run that finished with at least one variant failed
EXIT_BAD_INPUT, EXIT_VARIANT_FAILED = 2, 3

# what stops a process from outside (a cancelled job, the out-of-memory killer, Ctrl-C), never the tool's own fault
INTERRUPTING_SIGNALS = (1, 2, 9, 15)       # SIGHUP, SIGINT, SIGKILL, SIGTERM


class Interrupted(Exception):
    """A child process was stopped from outside (SIGTERM or SIGKILL from a scheduler's cancel or the out-of-memory
    killer, Ctrl-C): the run was interrupted, the tool did not fail. Never read as a verdict on the model; the job
    stops without a result, and rerunning it resumes."""


def raise_if_interrupted(returncode: int, what: str) -> None:
    """Raise Interrupted when ``returncode`` (a child's) says it was stopped by an interrupting signal."""
    if returncode < 0 and -returncode in INTERRUPTING_SIGNALS:
        raise Interrupted(f"{what} was stopped by signal {-returncode} (a cancelled job, the out-of-memory killer "
                          "or Ctrl-C): rerun the same command to resume")


def raise_if_signalled(returncode: int, what: str, output: str = "") -> None:
    """A child stopped by a signal: Interrupted for an interrupting one (the rerun resumes), else a RuntimeError
    naming the signal (a crash such as SIGSEGV or SIGABRT fails this run; it is never read as the input refusing
    the work). Nothing for a child that exited on its own."""
    raise_if_interrupted(returncode, what)
    if returncode < 0:
        raise RuntimeError(f"{what} was killed by signal {-returncode}" + (f": {output}" if output else ""))
