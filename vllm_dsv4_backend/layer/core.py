# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the plugin's DeepSeek-V4 layers share on every platform.

The CPU layer (:mod:`.cpu`, vLLM 0.32) and the CUDA layer (:mod:`.cuda`,
vLLM 0.33 / 0.34) are each vLLM's layer for their platform plus the
workspace; everything about the workspace that does not depend on the
platform lives here, once:

* the model-config reader (:func:`workspace_config`): vLLM's config and the
  layer's own attributes handed to the one config builder
  (:func:`.plan.build_workspace_config`, which reserves exactly the
  platform's lease plan), with the one reader of the indexer cache dtype
  (:func:`indexer_kv_dtype`) and vLLM's micro-batch count
  (:func:`num_ubatches`);
* the per-model manager registry (:func:`manager_for`: one manager per
  ``(vllm_config, model_key)``, created by the model's first layer) and the
  serving factory (:func:`make_workspace`);
* reserve-and-report (:func:`reserve_and_report`: the memory-budget check and
  ONE log line per manager at load: bytes per family, policy, micro-batches);
* the region holder (:class:`RegionHolder`: a layer's open
  :class:`~vllm_dsv4_backend.eager.Region` per micro-batch and the stream it
  was opened on), the one place that decides a model step begins: one per
  forward of the model's first layer for micro-batch 0 (under pipeline
  parallelism the stage's first layer). It marks the served model step
  (``WorkspaceManager.model_step``), runs the layer's own step-start work
  (the CPU layer's step tables) and logs the live counters every
  ``VLLM_DSV4_WORKSPACE_LOG_EVERY`` model steps and at shutdown, naming that
  layer (:func:`live_line`);
* the seam (:class:`WorkspaceLayer`): what both layers add to vLLM's class,
  under one set of names (``_workspace``, ``_dsv4_regions``,
  ``_dsv4_current_region()``, ``_dsv4_home_stream()``, ``dsv4_region()``,
  ``_dsv4_reserve()``, ``indexer_kv_dtype``), and the link from a swapped
  submodule back to its layer (:func:`link_owner` / :func:`owner_of`).

This module imports no vLLM at import time (micro-batch ids are looked up
lazily), so it loads under vLLM 0.32, 0.33 and 0.34 alike.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing.util
import threading
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from vllm_dsv4_backend import eager, envs, metrics, testing
from vllm_dsv4_backend._logging import init_logger
from vllm_dsv4_backend.formats.constants import layer_kind
from vllm_dsv4_backend.layer.plan import Dims, build_workspace_config
from vllm_dsv4_backend.workspace import WorkspaceConfig, WorkspaceManager
from vllm_dsv4_backend.workspace.budget import reserve_budget_bytes

logger = init_logger(__name__)

__all__ = [
    "RegionHolder",
    "WorkspaceLayer",
    "indexer_kv_dtype",
    "layer_kind",
    "layer_span",
    "link_owner",
    "live_line",
    "make_workspace",
    "manager_for",
    "num_ubatches",
    "owner_of",
    "reserve_and_report",
    "ubatch_id",
    "workspace_config",
]

MIB = 1 << 20

# (id(vllm_config), id(model_key)) -> the model's workspace manager.
_managers: dict[tuple[int, int], WorkspaceManager] = {}
_managers_lock = threading.Lock()
# A manager's /metrics labels (from vLLM's config, at creation) and its publisher
# (at reservation): :mod:`vllm_dsv4_backend.metrics`.
_metric_labels: weakref.WeakKeyDictionary[WorkspaceManager, dict[str, str]] = \
    weakref.WeakKeyDictionary()
_publishers: weakref.WeakKeyDictionary[WorkspaceManager, metrics.Publisher] = \
    weakref.WeakKeyDictionary()


# --- the link from a submodule (indexer, compressor) back to its layer -----------------


def link_owner(module: Any, layer: Any) -> None:
    """Let ``module`` (the layer's indexer or compressor, whose class the
    layer swapped) find ``layer``: a weak reference in a plain attribute
    (``nn.Module.__setattr__`` would register the parent as a submodule of
    its own child, a cycle ``.train()``/``.eval()`` recurse through)."""
    object.__setattr__(module, "_dsv4_owner_ref", weakref.ref(layer))


def owner_of(module: Any) -> Any:
    """The layer :func:`link_owner` linked ``module`` to (``None``: none, or gone)."""
    ref = getattr(module, "_dsv4_owner_ref", None)
    return ref() if ref is not None else None


# --- micro-batches -------------------------------------------------------------------

_UBATCHING: list[ModuleType | None] = []


def ubatch_id() -> int:
    """vLLM's ``dbo_current_ubatch_id()`` (0 on a vLLM without micro-batching).

    The function is read from vLLM's module at every call (tests replace it
    there); only the module import is cached."""
    if not _UBATCHING:
        try:
            _UBATCHING.append(importlib.import_module("vllm.v1.worker.ubatching"))
        except ImportError:
            _UBATCHING.append(None)
    module = _UBATCHING[0]
    if module is None:
        return 0
    return int(module.dbo_current_ubatch_id())


def num_ubatches(parallel_config: Any) -> int:
    """Micro-batches vLLM runs per step: ``parallel_config.num_ubatches``
    (2 with DBO, ``--ubatch-size`` otherwise) when micro-batching is on, else 1;
    each gets its own workspace slots (``dbo_current_ubatch_id()``)."""
    if not getattr(parallel_config, "use_ubatching", False):
        return 1
    return max(1, int(getattr(parallel_config, "num_ubatches", 2)))


# --- the workspace config ------------------------------------------------------------


def indexer_kv_dtype(vllm_config: Any) -> str:
    """The indexer K cache dtype asked for (``indexer_kv_dtype``, or
    ``use_fp4_indexer_cache`` mapped onto it; ``auto`` is ``fp8``), as vLLM
    resolves it: the plugin's one reader of the setting. The workspace sizes
    for it (:func:`workspace_config`) and both layers take the workspace's
    value (:attr:`WorkspaceLayer.indexer_kv_dtype`)."""
    return vllm_config.attention_config.resolve_indexer_kv_dtype("fp8")


def _sized_indexer_kv_dtype(value: str) -> str:
    """What the workspace sizes for: ``value`` if FP8 or MXFP4; anything else
    is refused by vLLM's indexer (or the CPU backend's checks) with its own
    message, so the workspace sizes for FP8."""
    return value if value in ("fp8", "mxfp4") else "fp8"


def workspace_config(vllm_config: Any, layer: Any, platform: str) -> WorkspaceConfig:
    """The model's workspace config, from vLLM's config and the attributes of
    its first attention layer (vLLM's ``DeepseekV4Attention`` on every
    platform: ``max_num_batched_tokens``, ``n_local_heads``,
    ``padded_heads``, ``head_dim``).

    It reserves exactly ``platform``'s lease plan (:data:`.plan.LEASE_PLAN`).
    """
    hf = vllm_config.model_config.hf_config
    dims = Dims(
        num_local_heads=int(layer.n_local_heads),
        padded_q_heads=int(layer.padded_heads),
        head_dim=int(layer.head_dim),
        index_n_heads=int(hf.index_n_heads),
        index_head_dim=int(hf.index_head_dim),
        index_topk=int(hf.index_topk),
    )
    return build_workspace_config(
        dims,
        max_num_batched_tokens=int(layer.max_num_batched_tokens),
        indexer_kv_dtype=_sized_indexer_kv_dtype(indexer_kv_dtype(vllm_config)),
        platform=platform,
        num_ubatches=num_ubatches(vllm_config.parallel_config),
    )


def make_workspace(
    config: WorkspaceConfig, *, device: torch.device | str, streams: Any = None
) -> WorkspaceManager:
    """A workspace manager with the serving settings: policy, debug and the
    test-only no-fence switch from :mod:`vllm_dsv4_backend.envs`."""
    return WorkspaceManager(
        config,
        layers=[],
        device=device,
        streams=streams,
        policy=envs.VLLM_DSV4_WORKSPACE,
        debug=envs.VLLM_DSV4_WORKSPACE_DEBUG,
        _unsafe_disable_fences_for_tests=not testing.fences_enabled(),
    )


def manager_for(
    vllm_config: Any,
    layer: Any,
    platform: str,
    model_key: object = None,
    *,
    streams: Any = None,
) -> WorkspaceManager:
    """The workspace of one model (one per ``(vllm_config, model_key)`` and
    process: the main model, an MTP drafter or a DSpark draft each pass their
    own ``model_key``), created by its first attention layer from
    :func:`workspace_config`; every layer registers itself with
    ``add_layer`` before it is reserved. ``streams``: the stream backend of a
    new manager (called with the device; ``None``: the manager's default)."""
    key = (id(vllm_config), id(model_key))
    with _managers_lock:
        manager = _managers.get(key)
        if manager is None:
            device = torch.device(vllm_config.device_config.device)
            backend = streams(device) if streams is not None else None
            manager = make_workspace(workspace_config(vllm_config, layer, platform),
                                     device=device, streams=backend)
            _managers[key] = manager
            _metric_labels[manager] = metrics.labels_from_vllm_config(vllm_config)
        return manager


# --- reserve and report --------------------------------------------------------------


def reserve_and_report(
    workspace: WorkspaceManager, platform: str, memory_utilization: float | None = None
) -> bool:
    """Reserve ``workspace`` once (at load, before vLLM profiles memory) and
    log ONE line for it: policy, bytes per family, layers and micro-batches.

    ``private`` is refused here (``WorkspaceBudgetError``, with the bytes and
    the alternatives) when one set of buffers per layer does not fit the
    memory budget (:func:`~vllm_dsv4_backend.workspace.budget.reserve_budget_bytes`:
    on CUDA what vLLM's ``memory_utilization`` share leaves, on CPU the
    available memory). Returns True if this call reserved it.
    """
    if workspace.reserved:
        return False
    budget = reserve_budget_bytes(workspace.device, memory_utilization)
    # Where vLLM allocates its own workspace: under --enable-sleep-mode (CUDA) the
    # "workspace" pool, discarded on sleep (registry entry sleep_mode_workspace_pool).
    from vllm_dsv4_backend.vllm_compat import sleep_mode

    with sleep_mode.reservation_context():
        workspace.reserve(budget_bytes=budget)
    stats = workspace.stats()
    per_family = ", ".join(
        f"{fam} {nbytes / MIB:.1f}" for fam, nbytes in stats["reserved_bytes_per_family"].items()
        if nbytes
    )
    logger.info(
        "vllm_dsv4_backend workspace (%s): policy %s, %.1f MiB reserved (%s MiB) for %d "
        "layers (%s), %d micro-batch(es), max_num_batched_tokens %d",
        platform,
        workspace.policy,
        stats["reserved_bytes_total"] / MIB,
        per_family or "none",
        stats["num_layers"],
        layer_span(list(stats["reserved_bytes_per_layer"])),
        stats["num_ubatches"],
        stats["max_num_batched_tokens"],
    )
    publisher = metrics.publisher_for(workspace, _metric_labels.get(workspace), platform)
    if publisher is not None:
        _publishers[workspace] = publisher
    return True


def layer_span(names: list[str]) -> str:
    """``first .. last`` of a workspace's layers (registration order), or the one
    name: under pipeline parallelism each stage's lines name only its own layers."""
    if not names:
        return "none"
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def live_line(workspace: WorkspaceManager, label: str) -> str:
    """The live summary plus the layer whose forwards mark the model steps (the
    stage's first layer under pipeline parallelism)."""
    return f"{workspace.live_summary(label)}, model steps at {workspace.first_layer}"


# --- the region holder ---------------------------------------------------------------


class RegionHolder:
    """A layer's open :class:`~vllm_dsv4_backend.eager.Region` per micro-batch,
    and the stream each was opened on (the region's home stream: vLLM's
    default stream; producers on aux streams declare it as consumer).

    :meth:`open` is the layer forward's ``with``: it opens the region for the
    current micro-batch (``dbo_current_ubatch_id()``), and every hook the
    forward reaches finds it with :meth:`current`. ``always_lookup=False``
    skips the micro-batch lookup when the workspace has one micro-batch
    (every region is then micro-batch 0); ``True`` asks vLLM every time, so a
    micro-batch id beyond the reservation is refused by the workspace.

    It is also where a model step begins (:attr:`starts_steps`, decided here
    only): ``on_step`` is the layer's own work at that moment.
    """

    __slots__ = ("_counts_steps", "_homes", "_log_every", "_lookup", "_no_region", "_on_step",
                 "_publisher", "_regions", "_seen", "layer_name", "platform", "workspace")

    def __init__(
        self, workspace: WorkspaceManager, layer_name: str, *, always_lookup: bool = False,
        platform: str = "", on_step: Callable[[], None] | None = None,
    ) -> None:
        self.workspace = workspace
        self.layer_name = layer_name
        self.platform = platform
        self._on_step = on_step
        self._log_every = envs.VLLM_DSV4_WORKSPACE_LOG_EVERY
        self._counts_steps: bool | None = None  # decided at the first open
        # The /metrics publisher, held by the model's last layer (decided at the first open;
        # False: not this layer, or no publisher).
        self._publisher: metrics.Publisher | bool | None = None
        self._seen = 0  # model steps begun (the first layer's holder only)
        self._lookup = always_lookup or workspace.config.num_ubatches > 1
        self._regions: dict[int, eager.Region] = {}
        self._no_region: dict[int, eager.NoRegion] = {}
        self._homes: dict[int, Any] = {}

    def _ubatch(self) -> int:
        return ubatch_id() if self._lookup else 0

    def current(self) -> eager.Region | eager.NoRegion:
        """The open region of the current micro-batch (a falsy
        :class:`~vllm_dsv4_backend.eager.NoRegion` outside one)."""
        ubatch = self._ubatch()
        region = self._regions.get(ubatch) if self._regions else None
        if region is not None:
            return region
        # One per micro-batch, built once: a piecewise replay asks on every step.
        none = self._no_region.get(ubatch)
        if none is None:
            none = self._no_region[ubatch] = eager.NoRegion(self.layer_name, ubatch)
        return none

    def home(self) -> Any:
        """The stream the current micro-batch's region was opened on."""
        return self._homes.get(self._ubatch()) if self._homes else None

    @property
    def starts_steps(self) -> bool:
        """Whether this layer's forwards begin the model steps: the
        workspace's first layer (the model's, or under pipeline parallelism
        the stage's), decided once, at the first forward, when every layer
        has registered."""
        counts = self._counts_steps
        if counts is None:
            counts = self._counts_steps = self.workspace.first_layer == self.layer_name
            if counts and self._log_every:
                _log_at_shutdown(self.workspace, self.platform)
        return counts

    def _step_begins(self) -> None:
        """A model step begins: count it, log the live counters every
        ``VLLM_DSV4_WORKSPACE_LOG_EVERY`` steps, run the layer's step-start work."""
        ws = self.workspace
        # Logged as model step N + 1 begins: N whole steps.
        if self._log_every and self._seen and self._seen % self._log_every == 0:
            logger.info("%s", live_line(ws, self.platform))
        self._seen = ws.model_step()
        if self._on_step is not None:
            self._on_step()

    @contextlib.contextmanager
    def open(self, num_tokens: int) -> Iterator[eager.Region]:
        """One forward's leases of this layer and micro-batch, all released
        on exit (returned or raised)."""
        ws = self.workspace
        ubatch = self._ubatch()
        if ubatch == 0 and self.starts_steps:
            self._step_begins()
        with eager.Region(ws, self.layer_name, num_tokens, ubatch) as region:
            self._regions[ubatch] = region
            self._homes[ubatch] = ws.backend.current_stream()
            try:
                yield region
            finally:
                self._regions.pop(ubatch, None)
                self._homes.pop(ubatch, None)
        if ubatch == 0:
            self._publish()

    def _publish(self) -> None:
        """After the model's last layer (micro-batch 0, its leases released): the
        step's figures to /metrics (:mod:`vllm_dsv4_backend.metrics`)."""
        pub = self._publisher
        if pub is None:
            if not self.workspace.reserved:
                return
            layers = self.workspace.layers
            last = next(reversed(layers)) if layers else None
            pub = _publishers.get(self.workspace) if last == self.layer_name else None
            self._publisher = pub = pub if pub is not None else False
        if pub is not False and not metrics.safe_publish(pub):  # type: ignore[arg-type]
            self._publisher = False


def _log_at_shutdown(workspace: WorkspaceManager, label: str) -> None:
    """Log ``workspace``'s live summary once when the process exits.

    ``multiprocessing.util.Finalize`` with an exit priority runs from
    multiprocessing's exit function, which a ``multiprocessing`` child (vLLM's
    engine-core and worker processes) calls itself before ``os._exit`` (where
    plain ``atexit`` handlers never run) and the main process through
    ``atexit``. A weak reference: the summary must not keep the model alive.
    """
    ref = weakref.ref(workspace)

    def log() -> None:
        ws = ref()
        if ws is not None:
            logger.info("%s (at shutdown)", live_line(ws, label))

    multiprocessing.util.Finalize(None, log, exitpriority=10)


# --- the seam: what both layers add to vLLM's class ----------------------------------


class WorkspaceLayer:
    """The workspace bookkeeping of the plugin's layers, once for both
    platforms: each layer is ``class X(<vLLM's layer>, WorkspaceLayer)``
    (vLLM's class first: its methods, and the layer's place in vLLM's class
    hierarchy, are unchanged), so the workspace, the region holder, the owner
    link, the step start and the reservation have one set of names on both.

    Attributes added to vLLM's class: ``_workspace`` (the model's
    :class:`~vllm_dsv4_backend.workspace.WorkspaceManager`), ``_dsv4_regions``
    (the layer's :class:`RegionHolder`) and ``_dsv4_memory_utilization``
    (vLLM's memory share the reservation must fit next to; ``None``: the
    available memory). No ``__init__``: a layer calls
    :meth:`_dsv4_attach_workspace` once vLLM's ``__init__`` has built it.
    """

    # vLLM's layer attributes the seam reads.
    prefix: str
    compress_ratio: int

    _workspace: WorkspaceManager
    _dsv4_regions: RegionHolder
    _dsv4_memory_utilization: float | None

    def _dsv4_attach_workspace(
        self, workspace: WorkspaceManager, platform: str, *, always_lookup: bool = False,
        on_step: Callable[[], None] | None = None,
    ) -> None:
        """Register this layer with ``workspace`` (model order: the first
        registered begins the steps) and give it its region holder
        (``platform`` names it in the log lines; ``always_lookup`` and
        ``on_step``: :class:`RegionHolder`)."""
        self._workspace = workspace
        self._dsv4_memory_utilization = None
        workspace.add_layer(self.prefix, self.compress_ratio)
        self._dsv4_regions = RegionHolder(workspace, self.prefix, always_lookup=always_lookup,
                                          platform=platform, on_step=on_step)

    def _dsv4_adopt(self, module: Any, cls: type) -> None:
        """Give ``module`` (this layer's indexer or compressor, built by vLLM)
        the plugin's subclass ``cls`` (which adds no state) and link it back to
        this layer (:func:`link_owner`)."""
        if not isinstance(module, cls):
            module.__class__ = cls
        link_owner(module, self)

    @property
    def indexer_kv_dtype(self) -> str:
        """The indexer K cache dtype (``fp8`` or ``mxfp4``) the workspace was
        sized for: :func:`indexer_kv_dtype`'s value, read once per model."""
        return self._workspace.config.params["indexer_kv_dtype"]

    # --- region state (per micro-batch) ----------------------------------------------

    def _dsv4_current_region(self) -> eager.Region | eager.NoRegion:
        """This layer's open region of the current micro-batch (a falsy
        :class:`~vllm_dsv4_backend.eager.NoRegion` outside its forward)."""
        return self._dsv4_regions.current()

    def _dsv4_home_stream(self) -> Any:
        """The stream the current micro-batch's region was opened on."""
        return self._dsv4_regions.home()

    def dsv4_region(self, num_tokens: int) -> contextlib.AbstractContextManager[eager.Region]:
        """One forward's leases of this layer and micro-batch, released on
        exit; the current stream is the region's home (default) stream; the
        model's first layer begins a model step here."""
        return self._dsv4_regions.open(num_tokens)

    def _dsv4_reserve(self) -> None:
        """Reserve the model's workspace once and log its line
        (:func:`reserve_and_report`); ``private`` is refused here, with the
        bytes and the budget, when one set of buffers per layer does not fit."""
        reserve_and_report(self._workspace, self._dsv4_regions.platform,
                           self._dsv4_memory_utilization)
