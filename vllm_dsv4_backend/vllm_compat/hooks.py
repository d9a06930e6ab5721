# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Post-import hooks and checked attribute replacement for vLLM runtime patches.

``register()`` runs in every vLLM process (API server, engine core, worker)
and must stay cheap, but the modules it patches (DeepSeek-V4 metadata
builders, ~4 s of imports) are only needed where the model runs. So a patch is
*armed* with :func:`when_imported`: it runs right after vLLM itself imports
the target module (or immediately if it already has), in whichever process
does so.

A patch that fails, whatever it raises, must not break vLLM: :func:`set_attr`
records every attribute a patch sets while a :func:`recording` is open, so
:func:`undo` puts vLLM's own objects back, and :func:`patch_failed` turns the
failure into one ERROR line naming the patch, or, when the plugin was asked
for explicitly (``VLLM_DSV4_ATTN_IMPL=plugin``), into a :class:`PatchError`
raised from inside that import, so startup stops with the patch's name.

The patches themselves are listed, with why and when to remove them, in
:mod:`.patches`; this module is the mechanism they share: one idempotency
marker (:func:`mark_port` / :func:`is_port`), the signature checks, the undo
record and :class:`PatchError`.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import inspect
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Any

from vllm_dsv4_backend._logging import init_logger

__all__ = [
    "PatchError",
    "check_accepts_keyword",
    "check_signature",
    "is_port",
    "mark_port",
    "patch_failed",
    "recording",
    "replace_attr",
    "resolve",
    "set_attr",
    "undo",
    "when_imported",
]

logger = init_logger(__name__)

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
    set_attr(owner, attr, mark_port(replacement))
    return True


# ----------------------------------------------------------------------------
# undo: a patch that fails leaves vLLM's own objects in place
# ----------------------------------------------------------------------------
Record = list[tuple[Any, str, bool, Any]]
"""``(owner, attr, had_own_value, own_value)`` per :func:`set_attr`, in order."""

_record = threading.local()
_logged_failures: set[str] = set()


def set_attr(owner: Any, attr: str, value: Any) -> None:
    """``setattr(owner, attr, value)``, kept in the open :func:`recording` (if any).

    Every attribute a patch sets on vLLM goes through here, so that when the
    patch fails later (in the same install or in another of its modules)
    :func:`undo` restores exactly what vLLM had.
    """
    record: Record | None = getattr(_record, "entries", None)
    if record is not None:
        # The owner's own dict, not getattr: a class attribute may be a
        # descriptor (staticmethod) or inherited (then undo deletes ours).
        own = getattr(owner, "__dict__", {})
        record.append((owner, attr, attr in own, own.get(attr)))
    setattr(owner, attr, value)


@contextlib.contextmanager
def recording(record: Record) -> Iterator[Record]:
    """Append every :func:`set_attr` made inside the block (this thread) to ``record``.

    A patch whose install imports a module that triggers another patch keeps
    its own record: the inner one opens its own.
    """
    outer = getattr(_record, "entries", None)
    _record.entries = record
    try:
        yield record
    finally:
        _record.entries = outer


def undo(record: Record) -> None:
    """Restore, newest first, every attribute in ``record``; empties it."""
    for owner, attr, had, value in reversed(record):
        if had:
            setattr(owner, attr, value)
        else:
            with contextlib.suppress(AttributeError):
                delattr(owner, attr)
    record.clear()


def patch_failed(name: str, where: str, error: BaseException, *, strict: bool,
                 kept: str = "vLLM's own code kept") -> PatchError:
    """The one outcome of patch ``name`` failing in ``where`` with ``error``.

    ``strict`` (``VLLM_DSV4_ATTN_IMPL=plugin``): returns the :class:`PatchError`
    to raise (``from error``), naming the patch and the cause. Otherwise logs one
    ERROR line naming the patch, ``kept`` (what vLLM keeps) and the cause, the
    traceback at DEBUG, and returns the error for the caller's report.
    """
    cause = str(error) if isinstance(error, PatchError) else f"{type(error).__name__}: {error}"
    if strict:
        from vllm_dsv4_backend import envs

        hint = ("" if envs.VLLM_DSV4_ATTN_IMPL != "plugin" else
                ". VLLM_DSV4_ATTN_IMPL=plugin makes this a startup error; unset it (or set "
                "VLLM_DSV4_ATTN_IMPL=vllm) to serve with vLLM's own code")
        return PatchError(f"vllm_dsv4_backend patch {name} failed in {where} on vLLM "
                          f"{_vllm_version()}: {cause}{hint}")
    # One ERROR line per patch and process: a check that fails at every engine
    # build repeats at DEBUG only.
    with _lock:
        first = name not in _logged_failures
        _logged_failures.add(name)
    log = logger.error if first else logger.debug
    log("vllm_dsv4_backend: patch %s not applied in %s, %s: %s", name, where, kept, cause)
    logger.debug("vllm_dsv4_backend: patch %s failure", name, exc_info=error)
    return PatchError(f"patch {name} not applied in {where}: {cause}")


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
        _call(hook, module)


def _call(hook: Callable[[ModuleType], None], module: ModuleType) -> None:
    """Run one hook; whatever it raises stays out of vLLM's import.

    The registry's hooks (``patches._install``, the layer's) handle their own
    failures and raise a :class:`PatchError` only when asked to (the plugin was
    requested explicitly): that one goes through, a startup error. This is the net
    for anything else a hook raises: one ERROR line naming it, vLLM's import goes
    on, and the module's other hooks still run (under ``plugin`` it raises too).
    """
    try:
        hook(module)
    except PatchError:
        raise
    except Exception as e:  # noqa: BLE001 - a plugin hook must not break vLLM's import
        from vllm_dsv4_backend import envs

        if envs.VLLM_DSV4_ATTN_IMPL == "plugin":
            raise
        name = getattr(hook, "__qualname__", None) or repr(hook)
        patch_failed(f"hook {name}", module.__name__, e, strict=False)


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
    _call(hook, module)


def disarm_all() -> list[str]:
    """Drop every hook still waiting for its module's import (the plugin
    stands aside after an unexpected error in ``register()``); returns the
    modules whose hooks were dropped. Hooks that already ran stay applied."""
    with _lock:
        dropped = sorted(_hooks)
        _hooks.clear()
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
    return dropped


def _initializing(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(spec is not None and getattr(spec, "_initializing", False))


def pending() -> list[str]:
    """Modules with hooks still waiting for their import (for logs and tests)."""
    with _lock:
        return sorted(_hooks)
