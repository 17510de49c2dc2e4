"""Error types shared by every layer.

Every problem a user can cause (bad environment, bad input file, bad strategy) raises a subclass of
:class:`AutoparError` whose message is one self-contained line. The CLI and the exception hook print such errors as
``autopar: error: <message>`` without a traceback; anything else is a bug and keeps its traceback.

The hook is installed by the first autopar call that can raise a user error -- ``set_context``,
``set_auto_parallel_context``, ``set_ps_context``, ``init``, the checkpoint callbacks and functions -- never by
``import autopar`` (no import side effects), so that an error raised before ``init()`` is one line too.
"""
import contextlib
import os
import sys


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


class UnsupportedError(AutoparError):
    """A MindSpore name autopar cannot honour on this stack; the message names it and what to use instead."""


# What to use instead of MindSpore's graph-mode Model internals that r1.3's gradient-accumulation sample reaches
# (Model_ACCU: _c_expression, train_thor's DatasetHelper, parallel._utils, Model._build_train_network)
ACCUMULATE_INSTEAD = ("MindSpore's graph-mode Model internals (the Model_ACCU sample) do not exist here; accumulate "
                      "gradients with Model(network, loss_fn, optimizer, grad_accumulation_steps=k)")


def unsupported(name: str, instead: str) -> type:
    """A stand-in for the MindSpore name ``name``: importing it works (a script's imports all load), and its FIRST USE
    -- calling it, instantiating it, subclassing it -- raises :class:`UnsupportedError` with one line saying what to
    use instead. ``tools/ms_names.py`` counts such names as *refused*, not as covered (``_autopar_unsupported``)."""
    message = f"{name} is not available in autopar: {instead}"

    def refuse(*args, **kwargs):
        raise UnsupportedError(message)

    return type(name.rsplit(".", 1)[-1], (), {"__new__": refuse, "__init_subclass__": classmethod(refuse),
                                               "_autopar_unsupported": message, "__doc__": message})


def refuses(name: str, instead: str):
    """Decorator for a method autopar keeps only to refuse: calling it raises one line (see :func:`unsupported`)."""
    message = f"{name} is not available in autopar: {instead}"

    def wrap(fn):
        def refuse(*args, **kwargs):
            raise UnsupportedError(message)

        refuse.__name__, refuse.__qualname__, refuse.__doc__ = fn.__name__, fn.__qualname__, message
        refuse._autopar_unsupported = message
        return refuse

    return wrap


_warned: set = set()


def warn_once(key: str, message: str) -> None:
    """Say once per process that something accepted does nothing useful here ("no silent result")."""
    if key in _warned:
        return
    _warned.add(key)
    import warnings

    warnings.warn(f"autopar: {message}", stacklevel=user_stacklevel())


_INTERNAL = (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the user's line: the first frame, from the caller of
    ``warnings.warn`` outwards, outside autopar and torch (a warning shown at autopar's own source line -- the
    dataset's ``self._init_pipeline(...)`` -- tells the user nothing about which of their lines caused it)."""
    import torch

    internal = _INTERNAL + (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,)
    frame, level = sys._getframe(1), 1
    while frame is not None and (os.path.abspath(frame.f_code.co_filename).startswith(internal)
                                 or frame.f_code.co_filename.startswith("<frozen")):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


_observers: list = []  # called as observer(exc_type, exc) before an uncaught exception is printed
_explainers: list = []  # explainer(exc) -> the one line an exception of torch's means for the user, or None


def explained_by(explainer) -> None:
    """Have ``explainer(exc)`` turn an exception torch raises deep inside (a DTensor's sharding propagation) into
    the one line that says what the user's network did and what to do; it must have no side effects (the dry run
    asks it too)."""
    if explainer not in _explainers:
        _explainers.append(explainer)


def explain(exc: BaseException) -> str | None:
    """The first explainer's line for ``exc`` (``_autopar_line`` when it has one), or None."""
    line = getattr(exc, "_autopar_line", None)
    for explainer in _explainers:
        if line is not None:
            break
        with contextlib.suppress(Exception):  # an explanation must never hide the error itself
            line = explainer(exc)
    return line
_prefix: list = [lambda: ""]


def on_uncaught(observer) -> None:
    """Call ``observer(exc_type, exc)`` before any uncaught exception is printed (the cluster layer records the
    crash for the scheduler, or stops quietly when the exception only echoes another rank's death). An observer
    that returns a string has it printed as the one error line instead of the traceback (a collective of torch's
    own that failed: what the rank was doing says more than gloo's C++ location)."""
    if observer not in _observers:
        _observers.append(observer)


def set_error_prefix(prefix) -> None:
    """``prefix()`` is put before the message of a one-line error (e.g. ``[rank 3] `` in a multi-rank job)."""
    _prefix[0] = prefix


def install_excepthook() -> None:
    """Print an uncaught :class:`AutoparError` as one line (``AUTOPAR_TRACEBACK=1`` keeps the traceback)."""
    previous = sys.excepthook
    if getattr(previous, "_autopar", False):
        return  # ours is the outermost hook already (torch's init_process_group wraps the hook it finds: call again
        # after it, so that an autopar error is not printed as "[rank0]: autopar: error: ...")

    def hook(exc_type, exc, tb):
        line = explain(exc)
        if not getattr(exc, "_autopar_observed", False):  # an inner hook of ours (under torch's) does not observe again
            for observer in list(_observers):
                try:
                    said = observer(exc_type, exc)
                except Exception:  # noqa: BLE001 - reporting must never hide the error itself
                    said = None
                if isinstance(said, str) and line is None:
                    line = said
            with contextlib.suppress(Exception):
                exc._autopar_observed = True
                exc._autopar_line = line
        if os.environ.get("AUTOPAR_TRACEBACK"):
            previous(exc_type, exc, tb)
            return
        if line is not None or issubclass(exc_type, AutoparError):
            print(f"autopar: error: {_prefix[0]()}{line if line is not None else exc}", file=sys.stderr, flush=True)
            return
        previous(exc_type, exc, tb)

    hook._autopar = True  # type: ignore[attr-defined]
    sys.excepthook = hook
