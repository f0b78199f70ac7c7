"""Every exception trainprobes raises on purpose derives from TrainprobesError.

The concrete classes mix in the builtin a caller would catch without knowing trainprobes
(ValueError for a bad value, TypeError for a value of the wrong kind, RuntimeError for a run
that did not complete), as hypothesis' errors.py does. Callers that want "anything trainprobes
refused" catch TrainprobesError. This module imports nothing of trainprobes: reference/ and
the probes both use it.
"""


class TrainprobesError(Exception):
    """The root: an error trainprobes raised on purpose, with a message meant for the user."""


class InvalidArgument(TrainprobesError, ValueError):
    """An argument with a value no probe can use; the message names it and says what works."""


class InvalidType(TrainprobesError, TypeError):
    """An argument of the wrong kind (a list where a tensor is needed, a bool for an int)."""


class ConfigError(InvalidArgument):
    """A [tool.trainprobes] table (or file) that cannot be turned into a suite."""


class TargetError(InvalidArgument):
    """A target that cannot be imported, or that is not what the probe expects."""


class SchemaError(TrainprobesError, ValueError):
    """A report that cannot be read: corrupt, truncated, or of an unknown schema."""


class DataFileError(TrainprobesError, ValueError):
    """A data file (log-probs, rollouts) that cannot be read; the message says where and why."""


class CannotJudge(TrainprobesError):
    """The gate (or any judge) lacks what it needs to decide: exit 2, with the reason."""


class MissingDependency(TrainprobesError, ImportError):
    """An optional package a feature needs is not installed; the message says what to install."""


class OutputExists(TrainprobesError, FileExistsError):
    """A file trainprobes was asked to write exists, and replacing it was not allowed
    (a baseline or a report someone else wrote): exit 2, never a silent overwrite."""
