# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Post-import hooks and checked attribute replacement for vLLM runtime patches.

``register()`` runs in every vLLM process (API server, engine core, worker)
and must stay cheap, but the modules it patches (DeepSeek-V4 metadata
builders, ~4 s of imports) are only needed where the model runs. So a patch is
*armed* with :func:`when_imported`: it runs right after vLLM itself imports
the target module (or immediately if it already has), in whichever process
does so. A failing patch raises :class:`PatchError` from inside that import,
so the engine stops with our message instead of a Triton error later.

The patches themselves are listed, with why and when to remove them, in
:mod:`.patches`; this module is the mechanism they share: one idempotency
marker (:func:`mark_port` / :func:`is_port`), the signature checks and
:class:`PatchError`.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import inspect
import sys
import threading
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

__all__ = [
    "PatchError",
    "check_accepts_keyword",
    "check_signature",
    "is_port",
    "mark_port",
    "replace_attr",
    "resolve",
    "when_imported",
]

_PORT_FLAG = "__vllm_dsv4_port__"


class PatchError(RuntimeError):
    """A vLLM hook point is missing or does not look as expected."""


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # pragma: no cover - only for the error message
        return "<unknown>"


def fail(symbol: str, problem: str) -> PatchError:
    """Build the loud error for hook point ``symbol``."""
    from vllm_dsv4_backend.vllm_compat.version import supported_versions_text

    return PatchError(
        f"vllm_dsv4_backend cannot patch vLLM {_vllm_version()}: {symbol}: {problem}. "
        f"The plugin supports vLLM {supported_versions_text()}; "
        "this vLLM changed a hook point the plugin relies on."
    )


def mark_port(obj: Any) -> Any:
    """Tag ``obj`` as a replacement installed by this package."""
    setattr(obj, _PORT_FLAG, True)
    return obj


def is_port(obj: Any) -> bool:
    return bool(getattr(obj, _PORT_FLAG, False))


def resolve(module: ModuleType, qualname: str) -> tuple[Any, str, Any]:
    """``(owner, attr, value)`` for a dotted ``qualname`` inside ``module``."""
    owner: Any = module
    parts = qualname.split(".")
    for part in parts[:-1]:
        if not hasattr(owner, part):
            raise fail(f"{module.__name__}.{qualname}", f"{part!r} not found")
        owner = getattr(owner, part)
    attr = parts[-1]
    if not hasattr(owner, attr):
        raise fail(f"{module.__name__}.{qualname}", "not found")
    return owner, attr, getattr(owner, attr)


def check_signature(symbol: str, obj: Any, expected: Iterable[str]) -> None:
    """Raise :class:`PatchError` unless ``obj``'s parameter names are ``expected``."""
    try:
        params = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError) as e:
        raise fail(symbol, f"cannot read its signature ({e})") from e
    if params and params[0] == "self":
        params = params[1:]
    want = list(expected)
    if params != want:
        raise fail(symbol, f"signature is ({', '.join(params)}), expected ({', '.join(want)})")


def check_accepts_keyword(symbol: str, obj: Any, name: str) -> None:
    """Raise :class:`PatchError` unless ``obj`` takes keyword ``name`` (or ``**kwargs``).

    For wrappers that forward ``*args, **kwargs`` and only rewrite one keyword:
    the exact parameter list of such a callable (a config class's generated
    ``__init__``, ``LLM.__init__``) changes every release without mattering.
    """
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError) as e:
        raise fail(symbol, f"cannot read its signature ({e})") from e
    if not any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise fail(symbol, f"takes no {name!r} keyword")


def replace_attr(
    module: ModuleType,
    qualname: str,
    replacement: Any,
    *,
    expected_params: Iterable[str] | None = None,
) -> bool:
    """Replace ``module.<qualname>`` with ``replacement`` after checking the original.

    Returns False (nothing done) if the attribute already holds one of our
    ports, True after replacing it. ``replacement`` is tagged with
    :func:`mark_port`.
    """
    owner, attr, current = resolve(module, qualname)
    if is_port(current):
        return False
    if expected_params is not None:
        check_signature(f"{module.__name__}.{qualname}", current, expected_params)
    if not hasattr(replacement, "__vllm_dsv4_original__"):
        with contextlib.suppress(AttributeError):  # builtins cannot carry it
            replacement.__vllm_dsv4_original__ = current
    setattr(owner, attr, mark_port(replacement))
    return True


# ----------------------------------------------------------------------------
# post-import hooks
# ----------------------------------------------------------------------------
_hooks: dict[str, list[Callable[[ModuleType], None]]] = {}
_lock = threading.RLock()


class _HookedLoader(importlib.abc.Loader):
    """Delegating loader that runs the module's hooks after ``exec_module``."""

    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _run_hooks(self._name, module)

    def __getattr__(self, item: str) -> Any:
        # get_source/get_code/is_package etc. (inspect, linecache, pickle).
        return getattr(self._loader, item)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of hooked modules found by the finders after it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if fullname not in _hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader, fullname)
                return spec
        return None


_finder = _PostImportFinder()


def _run_hooks(name: str, module: ModuleType) -> None:
    with _lock:
        hooks = _hooks.pop(name, [])
    for hook in hooks:
        hook(module)


def when_imported(module_name: str, hook: Callable[[ModuleType], None]) -> None:
    """Run ``hook(module)`` once ``module_name`` is imported (now if it already is).

    Each call arms one run of ``hook``; callers keep their own idempotency.
    """
    with _lock:
        module = sys.modules.get(module_name)
        if module is None or getattr(module, "__spec__", None) is None or _initializing(module):
            _hooks.setdefault(module_name, []).append(hook)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    hook(module)


def _initializing(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(spec is not None and getattr(spec, "_initializing", False))


def pending() -> list[str]:
    """Modules with hooks still waiting for their import (for logs and tests)."""
    with _lock:
        return sorted(_hooks)
