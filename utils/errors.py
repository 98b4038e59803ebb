"""Errors the entry scripts turn into one clear line instead of a traceback."""


class UserError(Exception):
    """A mistake in the user's input (config, data, paths) with a message that says what to do."""


class ConfigError(UserError):
    """The YAML profile or a command-line override does not fit the schema."""


class LaunchError(ConfigError):
    """The launch does not fit the accelerate config or the machine. Every process of the launch finds
    the same and raises this, so only the first process on each machine says it."""


class DataError(UserError):
    """The training data cannot be used as it is."""


class ModelNotFoundError(UserError):
    """The model path is neither a local folder nor a cached hub checkpoint."""


class TrainingDiverged(UserError):
    """Too many steps in a row had a non-finite loss or gradient."""


class ProcessLost(UserError):
    """Another process of a several-process run died or stalled; the survivors stop."""


class TrainingInterrupted(UserError):
    """A signal stopped training after a checkpoint; resuming continues it."""

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code


def from_loader_worker(exc: BaseException) -> "UserError | None":
    """torch's DataLoader re-raises an error of a worker process as the same type with the worker's
    whole traceback as its message: a ``UserError`` gets its own one line back (None otherwise)."""
    text = str(exc).strip()
    if not isinstance(exc, UserError) or "Original Traceback" not in text:
        return None
    last = text.splitlines()[-1]
    prefix = f"{type(exc).__module__}.{type(exc).__name__}: "
    return type(exc)(last[len(prefix):] if last.startswith(prefix) else last)
