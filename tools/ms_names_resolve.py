"""Looking a MindSpore name up in autopar (``mindspore`` -> ``autopar``): import the module path, getattr the rest;
a member of a class also counts when a class of its MRO assigns ``self.member`` (a torch module's instance
attribute); a keyword must be a parameter of the autopar callable (or pass the context setters' own check); a name
autopar defines only to refuse it (``_autopar_unsupported``) is *refused*."""
from __future__ import annotations

import importlib
import inspect
import re
import warnings

# setters whose keywords go through **kwargs: a keyword is known unless the setter says "unknown key"
PROBED = {"set_context", "set_auto_parallel_context", "set_ps_context", "set_algo_parameters"}


def _lookup(path: str):
    """The autopar object for a mindspore dotted path; raises LookupError."""
    parts = ["autopar"] + path.split(".")[1:]
    obj = None
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for j, attr in enumerate(parts[i:], start=i):
            try:
                obj = _member(obj, attr)
            except AttributeError:
                try:
                    obj = importlib.import_module(".".join(parts[: j + 1]))
                except ImportError:
                    raise LookupError(path) from None
        return obj
    raise LookupError(path)


def _member(cls, attr: str):
    """``cls.attr``, or (for an attribute a torch module sets in ``__init__``) the class itself when some class of its
    MRO assigns ``self.attr``; raises AttributeError."""
    try:
        return getattr(cls, attr)
    except AttributeError:
        pass
    if isinstance(cls, type):
        pattern = re.compile(rf"self\.{re.escape(attr)}\s*(:[^=]*)?=[^=]")
        for klass in cls.__mro__:
            try:
                if pattern.search(inspect.getsource(klass)):
                    return cls
            except (OSError, TypeError):
                continue
    raise AttributeError(attr)


def _refusal(obj) -> str | None:
    return getattr(obj, "_autopar_unsupported", None) if obj is not None else None


def _keyword_ok(target: str, keyword: str) -> bool:
    fn = _lookup(target)
    name = target.rsplit(".", 1)[-1]
    if name in PROBED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                fn(**{keyword: None})
            except Exception as exc:  # noqa: BLE001 - any error but "unknown key" means the key is known
                return "unknown key" not in str(exc)
        return True
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    params = sig.parameters
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def resolve(name: str) -> tuple[str, str]:
    """("ok" | "refused" | "missing", detail)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if name.endswith("=)"):
                target, keyword = name[:-2].split("(")
                refused = _refusal(_lookup(target))
                if refused:
                    return "refused", refused
                return ("ok", "") if _keyword_ok(target, keyword) else ("missing", "keyword not accepted")
            obj = _lookup(name)
    except LookupError:
        return "missing", "not found"
    except Exception as exc:  # noqa: BLE001 - importing a module that fails is a finding, not a crash
        return "missing", f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
    refused = _refusal(obj)
    return ("refused", refused) if refused else ("ok", "")
