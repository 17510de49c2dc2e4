"""Error types shared by every layer.

Every problem a user can cause (bad environment, bad input file, bad strategy) raises a subclass of
:class:`AutoparError` whose message is one self-contained line. The CLI and the worker exception hook print
such errors as ``autopar: error: <message>`` without a traceback; anything else is a bug and keeps its traceback.
"""


class AutoparError(RuntimeError):
    """Base class of all user-facing autopar errors (one-line message, no traceback needed)."""


class ClusterError(AutoparError):
    """The process cluster could not be formed or lost a member (environment, rendezvous, launch)."""


class CommError(AutoparError):
    """A collective could not be issued or did not complete."""


class DatasetError(AutoparError):
    """A dataset file or pipeline is invalid (names the file or the operation)."""


class StrategyError(AutoparError):
    """A shard strategy is invalid for its operator, its inputs or the device count."""


class CheckpointError(AutoparError):
    """A checkpoint or strategy file is missing, corrupt or does not match the network."""


class ConfigError(AutoparError, ValueError):
    """An unknown or invalid context / configuration value."""


class TrainingError(AutoparError):
    """Training cannot continue (an invalid loss, a model used without what it needs)."""
