"""Every rank started by ``autopar launch`` -- a torchrun-style script that never imports autopar too -- leaves its
verdict ("ok"/"failed") in the file ``AUTOPAR_END_MARK`` names (``<mark>.<pid>``: a child process it spawns leaves its
own, under its own pid).

Why: torch's C++ threads now and then abort a process (SIGABRT, "terminate called without an active exception")
while the interpreter tears down after the script had finished; the launcher counts such an abort as the clean end it
was only where this process said "ok" first. The verdict is written from atexit, before that teardown; the first
verdict stands (autopar's own watchdog, registered later, runs first and knows more: a rank that only echoed another
rank's death, a failed collective). Standard library only: this runs at the start of every worker.
A ``sitecustomize`` further down the path (the site's own) still runs after this one.
"""
import atexit
import builtins
import os
import sys

END_MARK = "AUTOPAR_END_MARK"


def mark_end(verdict: str) -> None:
    """Write this process's verdict where the launcher looks for it, unless a verdict is there already."""
    base = os.environ.get(END_MARK)
    if not base:
        return
    if verdict == "ok":  # an abort in the teardown from here on is forgiven: its stack dump would only be noise
        import faulthandler

        faulthandler.disable()
    try:
        with open(f"{base}.{os.getpid()}", "x") as fh:
            fh.write(verdict + "\n")
    except OSError:  # there already (the first verdict stands), or the log folder is gone: nothing to add
        pass


def watch_exit_calls(note) -> None:
    """``sys.exit(status)`` and the ``exit``/``quit`` builtins call ``note(status)`` first: atexit cannot see the
    status a ``SystemExit`` carries. Left out: a bare ``raise SystemExit(3)``."""

    def wrap(original):
        if getattr(original, "_autopar_exit", None) == note:
            return original

        def exit(status=None):
            note(status)
            return original(status)

        exit._autopar_exit = note  # type: ignore[attr-defined]
        exit.__doc__ = getattr(original, "__doc__", None)
        return exit

    sys.exit = wrap(sys.exit)
    for name in ("exit", "quit"):
        if hasattr(builtins, name):
            setattr(builtins, name, wrap(getattr(builtins, name)))


def _install() -> None:
    failed = []

    def note(status=None):
        if status not in (None, 0):
            failed.append(status)

    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        failed.append(exc_type)
        previous(exc_type, exc, tb)

    sys.excepthook = hook
    watch_exit_calls(note)
    atexit.register(lambda: mark_end("failed" if failed else "ok"))


def _chain() -> None:
    """Run the ``sitecustomize`` this one stands in front of, if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    mine = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401
    except ImportError as exc:
        if exc.name != "sitecustomize":  # the site's own hook failed inside: site.py would say so too
            raise
        if mine is not None:
            sys.modules["sitecustomize"] = mine
    finally:
        sys.path[:] = saved


if __name__ == "sitecustomize":
    if os.environ.get(END_MARK):
        _install()
    _chain()
