# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Failure injection into the plugin's patch registry (worker side): every entry of
``vllm_compat.patches.PATCHES`` gets a failure that is not a ``PatchError``, before or
after its real install runs, and what the install changed in vLLM is recorded.

Used in fresh interpreters (the patches must not leak into pytest's process) by the
workers of tests/vllm/test_patch_failures.py and test_other_models.py. Imports neither
vLLM nor the plugin at import time: the order of those imports is part of what the
workers test.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any

EXCEPTIONS: tuple[type[Exception], ...] = (AttributeError, TypeError, RuntimeError, KeyError)

# Registry entries without an install function and the plugin function whose failure
# stands for theirs (patched on the module named, in the worker).
ELSEWHERE: dict[str, tuple[str, str]] = {
    # The layer is resolved and placed by the hook install_attention_layer arms.
    "attention_layer": ("vllm_dsv4_backend.layer", "get_attention_layer_cls"),
    # Built when vLLM asks the plugin's SWA backend for its builder.
    "swa_unread_kernels": ("vllm_dsv4_backend.backend", "_cpu_swa_builder_cls"),
    # Read at each model's workspace reservation.
    "sleep_mode_workspace_pool": ("vllm_dsv4_backend.vllm_compat.sleep_mode",
                                  "_vllm_alloc_context"),
}
# Entries a mode does not fail. mxfp4_indexer_cache is applied while the plugin's layer
# is resolved: failing attention_layer in "before" would leave it unreached, so it is
# failed in "after" only, where attention_layer is left to surface its failure.
NOT_FAILED: dict[str, frozenset[str]] = {
    "after": frozenset({"attention_layer"}),
    "before": frozenset({"mxfp4_indexer_cache"}),
}
def exception_for(name: str) -> type[Exception]:
    """The failure entry ``name`` gets (by its place in the registry)."""
    from vllm_dsv4_backend.vllm_compat import patches

    return EXCEPTIONS[list(patches.PATCHES).index(name) % len(EXCEPTIONS)]


Snapshot = dict[tuple[int, str], tuple[Any, str, Any]]


def snapshot() -> Snapshot:
    """Every attribute of every imported vLLM module and of the classes it defines."""
    snap: Snapshot = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "vllm" or name.startswith("vllm.")):
            continue
        owners: list[Any] = [module]
        owners += [v for v in list(vars(module).values())
                   if isinstance(v, type) and v.__module__ == name]
        for owner in owners:
            for key, value in list(vars(owner).items()):
                snap[(id(owner), key)] = (owner, key, value)
    return snap


def changed_since(before: Snapshot, after: Snapshot) -> list[tuple[Any, str, Any]]:
    """``(owner, attr, vLLM's value)`` of every attribute ``before`` had that changed."""
    return [entry for key, entry in before.items()
            if key not in after or after[key][2] is not entry[2]]


def failing(name: str, real: Callable[..., Any], mode: str, exc: type[Exception],
             changed: dict[str, list[tuple[Any, str, Any]]]) -> Callable[..., Any]:
    """``real`` that raises ``exc`` before (``before``) or after (``after``) running;
    in ``after`` it records what ``real`` changed in vLLM."""

    def failing(*args: Any, **kwargs: Any) -> Any:
        if mode == "after":
            before = snapshot()
            real(*args, **kwargs)
            changed.setdefault(name, []).extend(changed_since(before, snapshot()))
        raise exc(f"injected into {name}")

    return failing


def inject(mode: str, names: list[str], changed: dict[str, list[tuple[Any, str, Any]]],
            elsewhere: bool) -> None:
    """Fail every entry ``mode`` fails: the registry's installs, or (``elsewhere``)
    the :data:`ELSEWHERE` functions (their modules import vLLM: only once it is)."""
    from vllm_dsv4_backend.vllm_compat import patches

    for name in names:
        if name in NOT_FAILED.get(mode, ()):
            continue
        patch = patches.PATCHES[name]
        exc = exception_for(name)
        if patch.install is not None and not elsewhere:
            patches.PATCHES[name] = dataclasses.replace(
                patch, install=failing(name, patch.install, mode, exc, changed))
        elif patch.install is None and elsewhere and name in ELSEWHERE:
            module = importlib.import_module(ELSEWHERE[name][0])
            attr = ELSEWHERE[name][1]
            setattr(module, attr, failing(name, getattr(module, attr), mode, exc, changed))


def capture_errors() -> dict[tuple[str, float], None]:
    """ERROR records of vLLM's and the plugin's loggers from now on (keys: message, time)."""
    seen: dict[tuple[str, float], None] = {}

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            # A record seen by both loggers counts once.
            if record.levelno >= logging.ERROR:
                seen[(record.getMessage(), record.created)] = None

    for logger_name in ("vllm", "vllm_dsv4_backend"):
        logging.getLogger(logger_name).addHandler(Handler())
    return seen


