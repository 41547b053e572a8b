"""The errors that bad input raises: each names the file and line, or the config key."""


class InputError(Exception):
    """Bad input data: the message names the file, the line and the field."""

    def __init__(self, path, message: str, line: int | None = None, field: str | None = None):
        self.path, self.line, self.field, self.reason = path, line, field, message
        where = f"{path}:{line}" if line is not None else str(path)
        if field:
            where += f": field '{field}'"
        super().__init__(f"{where}: {message}")


class DeviceError(Exception):
    """A job that asked for GPUs on a machine where CUDA is not usable: the message names the host."""


class ConfigError(Exception):
    """A config that passes the schema but names things that do not exist or cannot work."""


class StorageError(Exception):
    """A write that failed for want of space (a full disk, a used-up quota): the message names the
    file and the file system."""


class TrainingError(Exception):
    """A stage whose training cannot go on (a loss or gradient that is not a finite number): the
    message names the step."""
