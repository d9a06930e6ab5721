# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``VLLM_DSV4_*`` environment variables, read lazily (``vllm.envs`` style).

Read a value with ``vllm_dsv4_backend.envs.VLLM_DSV4_KERNEL`` (evaluated on
every access, so tests may change ``os.environ``). ``register_with_vllm()``
merges :data:`environment_variables` into ``vllm.envs.environment_variables``
so vLLM's ``validate_environ`` does not warn "Unknown vLLM environment
variable" about them, and ``vllm.envs.VLLM_DSV4_*`` works too.

A malformed value raises ``ValueError`` naming the variable, the allowed
values and the value received; nothing falls back silently.

Variables:

``VLLM_DSV4_WORKSPACE`` = ``shared`` (default) | ``private`` | ``off``
    Per-layer workspace policy: ``shared`` shares storage between layers only
    where a stream/event fence proves no overlap, ``private`` gives every layer
    its own storage (most memory, no sharing), ``off`` uses the plain caching
    allocator (the benchmark baseline).
``VLLM_DSV4_WORKSPACE_DEBUG`` = ``0`` (default) | ``1``
    Poison released workspace regions with NaN and raise on overlapping leases.
``VLLM_DSV4_WORKSPACE_LOG_EVERY`` = ``0`` (default, off) | a positive int ``N``
    The worker logs one line of live workspace counters every ``N`` served
    model steps and at a graceful shutdown (``--shutdown-timeout`` > 0; vLLM's
    default SIGKILLs the worker): model steps, leases and allocations in leased
    families per step (0 except under ``off``), fence waits, reserved and
    peak leased MiB.
``VLLM_DSV4_KERNEL`` = ``auto`` (default) | ``torch`` | ``vllm_cpu``
    Sparse-MLA path of the CPU layer: ``torch``, the plugin's vectorized PyTorch
    (runs anywhere, the oracle); ``vllm_cpu`` / ``auto``, the op vLLM's layer
    calls (its C++ kernel, or the plugin's registered fallback where vLLM's
    library lacks it; ``vllm_cpu`` refuses the fallback). The CUDA layer always
    runs vLLM's FlashMLA kernels and refuses any value but ``auto``.
``VLLM_DSV4_ATTN_IMPL`` = ``auto`` (default) | ``plugin`` | ``vllm``
    Which DeepSeek-V4 attention layer the model builds: ``plugin`` installs the
    plugin's layer and makes any reason not to (an unsupported vLLM version or
    platform, a changed hook point or copied body) a startup error; ``vllm``
    keeps vLLM's own (for comparison); ``auto`` takes the plugin's layer where
    it is supported and otherwise stands aside with one ERROR line, vLLM
    serving every model with its own layer.
``VLLM_DSV4_SKIP_VERSION_CHECK`` = ``0`` (default) | ``1``
    Load on a vLLM minor version the plugin does not know (not 0.32 / 0.33 /
    0.34; logged as a warning) instead of standing aside.
``VLLM_DSV4_DUMMY_INIT`` = ``1`` (default) | ``0``
    Honour the ``vllm_dsv4_dummy_init`` marker of a model's ``config.json``
    under ``--load-format dummy`` (seeded fan-in weights); ``0`` keeps vLLM's
    own dummy weights.
``VLLM_DSV4_MARKER_DIR`` = path (default unset)
    When set, every vLLM process that loads the plugin writes
    ``<dir>/<role>-<pid>.json`` (role, pid, what it patched) and updates it as
    patches are applied: the tests' proof that the plugin ran in the API
    server, engine-core and worker processes. The plugin's layers add
    ``<dir>/layers/layer-<kind>-<pid>.json`` and the workspace counters
    ``<dir>/layers/workspace-<pid>.json`` (rewritten after every layer forward).
``VLLM_DSV4_METRICS`` = ``1`` (default) | ``0``
    Publish the workspace's live figures on ``vllm serve``'s ``/metrics``
    (:mod:`vllm_dsv4_backend.metrics`); ``0``: nothing is written or registered.
``VLLM_DSV4_METRICS_DIR`` = path (set by the plugin, not by users)
    The directory the front end created for this server's workspace figures,
    inherited by its engine and worker processes (the front end always
    replaces it with a fresh one).
``VLLM_DSV4_TEST_UNSAFE_NO_FENCES`` = ``0`` (default) | ``1``
    Test only: the workspace skips every cross-stream fence (the load test
    shows what that does; never set it in production).
``VLLM_DSV4_TEST_PERTURB_SINK`` = a float (default unset)
    Test only: add this to layer 0's attention sink after loading (the
    parity test's negative control).
``VLLM_DSV4_TEST_ORACLE_FAULT`` = ``off`` (default) | ``topk_off_by_one`` | ``compress_late``
| ``stale_kv`` | ``alias49236``
    Test only, the transformers oracle's negative controls (CPU layer):
    ``topk_off_by_one`` makes every entry id of a C4 layer's top-k table one
    less (each selected entry reads its predecessor, entry 0 none); ``compress_late``
    makes compressed entry ``j`` visible one token late (``j < p // ratio``
    instead of ``j < (p + 1) // ratio``, C4 and C128). Read on every step.
    Two more, added with the trained model's lm_eval gates (issue 40 item 4,
    which fail on the first): ``stale_kv``
    (the sliding-window read misses every row the step itself wrote, as a
    read that ran before the step's KV insert landed) and ``alias49236``
    (vLLM #49236's layout, aux families at one offset: the indexer q's bytes
    land over the C4 top-k table before the sparse MLA reads it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["environment_variables", "register_with_vllm"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> Callable[[], str]:
    def read() -> str:
        value = os.environ.get(name, default).strip().lower() or default
        if value not in allowed:
            raise ValueError(
                f"{name}: expected one of {list(allowed)}, got {os.environ.get(name)!r}"
            )
        return value

    return read


def _flag(name: str, default: bool) -> Callable[[], bool]:
    def read() -> bool:
        raw = os.environ.get(name)
        if raw is None:
            return default
        value = raw.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise ValueError(f"{name}: expected 0 or 1, got {raw!r}")

    return read


def _float(name: str) -> Callable[[], float | None]:
    def read() -> float | None:
        raw = os.environ.get(name, "").strip()
        if not raw:
            return None
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{name}: expected a float, got {raw!r}") from None

    return read


def _count(name: str, default: int) -> Callable[[], int]:
    def read() -> int:
        raw = os.environ.get(name, "").strip()
        if not raw:
            return default
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {raw!r}")
        return value

    return read


def _path(name: str) -> Callable[[], str | None]:
    def read() -> str | None:
        value = os.environ.get(name, "").strip()
        return value or None

    return read


environment_variables: dict[str, Callable[[], Any]] = {
    "VLLM_DSV4_WORKSPACE": _choice("VLLM_DSV4_WORKSPACE", "shared", ("shared", "private", "off")),
    "VLLM_DSV4_WORKSPACE_DEBUG": _flag("VLLM_DSV4_WORKSPACE_DEBUG", False),
    "VLLM_DSV4_WORKSPACE_LOG_EVERY": _count("VLLM_DSV4_WORKSPACE_LOG_EVERY", 0),
    "VLLM_DSV4_KERNEL": _choice(
        "VLLM_DSV4_KERNEL", "auto", ("auto", "torch", "vllm_cpu")
    ),
    "VLLM_DSV4_ATTN_IMPL": _choice("VLLM_DSV4_ATTN_IMPL", "auto", ("auto", "plugin", "vllm")),
    "VLLM_DSV4_SKIP_VERSION_CHECK": _flag("VLLM_DSV4_SKIP_VERSION_CHECK", False),
    "VLLM_DSV4_DUMMY_INIT": _flag("VLLM_DSV4_DUMMY_INIT", True),
    "VLLM_DSV4_MARKER_DIR": _path("VLLM_DSV4_MARKER_DIR"),
    "VLLM_DSV4_METRICS": _flag("VLLM_DSV4_METRICS", True),
    "VLLM_DSV4_METRICS_DIR": _path("VLLM_DSV4_METRICS_DIR"),
    "VLLM_DSV4_TEST_UNSAFE_NO_FENCES": _flag("VLLM_DSV4_TEST_UNSAFE_NO_FENCES", False),
    "VLLM_DSV4_TEST_PERTURB_SINK": _float("VLLM_DSV4_TEST_PERTURB_SINK"),
    "VLLM_DSV4_TEST_ORACLE_FAULT": _choice(
        "VLLM_DSV4_TEST_ORACLE_FAULT", "off",
        ("off", "topk_off_by_one", "compress_late", "stale_kv", "alias49236"),
    ),
}

if False:  # static names for type checkers and IDEs  # noqa: SIM108
    VLLM_DSV4_WORKSPACE: str = "shared"
    VLLM_DSV4_WORKSPACE_DEBUG: bool = False
    VLLM_DSV4_WORKSPACE_LOG_EVERY: int = 0
    VLLM_DSV4_KERNEL: str = "auto"
    VLLM_DSV4_ATTN_IMPL: str = "auto"
    VLLM_DSV4_SKIP_VERSION_CHECK: bool = False
    VLLM_DSV4_DUMMY_INIT: bool = True
    VLLM_DSV4_MARKER_DIR: str | None = None
    VLLM_DSV4_METRICS: bool = True
    VLLM_DSV4_METRICS_DIR: str | None = None
    VLLM_DSV4_TEST_UNSAFE_NO_FENCES: bool = False
    VLLM_DSV4_TEST_PERTURB_SINK: float | None = None
    VLLM_DSV4_TEST_ORACLE_FAULT: str = "off"


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(environment_variables) + __all__)


def register_with_vllm() -> bool:
    """Merge our variables into ``vllm.envs.environment_variables``.

    Returns True if vLLM exposes that dict (0.32/0.33 do) and it now holds our
    names; existing entries are never overwritten. Idempotent.
    """
    import vllm.envs as vllm_envs

    table = getattr(vllm_envs, "environment_variables", None)
    if not isinstance(table, dict):
        return False
    for name, reader in environment_variables.items():
        table.setdefault(name, reader)
    return True
