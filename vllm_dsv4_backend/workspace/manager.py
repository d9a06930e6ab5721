# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-layer workspace manager for an attention eager region (model-agnostic:
the caller declares its families and layer kinds in a ``WorkspaceConfig``).

vLLM #49236 handed one model-wide scratch pool to all 43 layers of
DeepSeek-V4 and put three buffer families at offset 0, while two of them were
written on auxiliary CUDA streams; nothing in the pool ordered a producer after the
previous consumer of the same bytes, so it was reverted (#52836). This
manager keeps the preallocation and makes the reuse provable:

* **Reserved at load.** ``reserve()`` allocates one uint8 storage for every
  slot (see ``sizing.plan_layout``), so vLLM's memory profiling sees it. No
  lease ever allocates (``shared``/``private``); a request beyond the
  reservation raises ``WorkspaceCapacityError``, never grows.
* **Stable addresses.** A lease for ``T`` tokens returns the prefix ``[:T]``
  of the slot's views; the views are cached per ``T``, so the same layer,
  family, micro-batch and ``T`` always get the same tensors and data_ptrs.
* **Fenced sharing (the proof lives here).** Each slot remembers the streams
  that used its last lease (the producer's, plus every stream declared with
  ``Lease.used_on``). When a new lease of the slot is taken for a producer on
  stream ``S``: for each of those streams ``C``: if ``C`` is ``S``, stream
  order already puts the new producer after the old consumers; otherwise the
  manager records an event on ``C`` *now* and makes ``S`` wait for it. An
  event recorded now on ``C`` completes after everything ``C`` had been given,
  the old consumers included (they were enqueued before ``release()``, which
  must precede the next lease: a slot with a live lease cannot be leased).
  Recording at hand-over instead of at release costs nothing when producer
  and consumer share a stream (most families) and never under-synchronizes.
* **Bounded by the scheduler's worst case.** A lease for ``T`` tokens of
  micro-batch ``u`` is served iff ``0 <= T <= max_num_batched_tokens`` and
  ``0 <= u < num_ubatches``; anything else raises ``WorkspaceCapacityError``
  (a ``ValueError``) naming the family, layer, ``T``, ``u``, the bytes needed
  and the bytes reserved, before any slot is taken, any view is built or
  anything is allocated (under every policy, ``off`` included). The bound is
  vLLM's own: the scheduler never schedules more than
  ``scheduler_config.max_num_batched_tokens`` tokens in a step (prefill
  chunks, decode and speculative-decode verification tokens together), CUDA
  graph capture sizes are filtered to at most that, a micro-batch carries a
  part of the step, and the MTP/DSpark drafter's token bound is the same
  ``max_num_batched_tokens``; vLLM's own per-layer buffers
  (``DeepseekV4Attention.max_num_batched_tokens``) have the same bound.
  Micro-batch ids come from ``dbo_current_ubatch_id()`` and are below
  ``parallel_config.num_ubatches`` (2 with DBO, ``--ubatch-size`` otherwise),
  which the layers pass as ``WorkspaceConfig.num_ubatches``.
* **No aliasing of concurrent families or micro-batches.** Families have
  disjoint bytes (they can be live at once on different streams), and every
  micro-batch has its own slots.

Policies (``VLLM_DSV4_WORKSPACE``): ``shared`` (default; ``shared_slots``
slots per family and micro-batch, taken by the layers in turn behind fences),
``private`` (a slot per layer, family and micro-batch; fences still order a
layer's step ``n+1`` after its step ``n``) and ``off`` (every lease is fresh
``torch.empty`` from the caching allocator, the baseline; consumer streams get
``record_stream``). ``VLLM_DSV4_WORKSPACE_DEBUG=1`` poisons every released
region (NaN bytes for floats, 0xFF for uint8, the most negative int for int32,
enqueued on the producer's stream after the consumers) and raises on leases
whose bytes overlap a live lease.

Typical use in a layer's eager region::

    ws = manager.lease(layer_name, family, num_tokens, stream=aux0)
    ...  # producer kernels on aux0 write ws[view]
    ws.used_on(default_stream)
    ...  # consumer kernels on the default stream read it
    ws.release()  # after the last consumer is enqueued

The manager is not thread-safe; vLLM's DBO micro-batch threads run one at a
time, and each micro-batch has its own slots.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from .lease import (  # noqa: F401  (re-exported: the manager's public names)
    Lease,
    WorkspaceBudgetError,
    WorkspaceCapacityError,
    WorkspaceLeaseError,
    _poison,
    _Slot,
)
from .live import COUNTERS, LiveCounters, format_summary
from .sizing import (
    POLICIES,
    BufferSpec,
    Layout,
    WorkspaceConfig,
    plan_layout,
    private_fit_tokens,
)
from .streams import CudaStreamBackend, StreamBackend, default_backend

# The settings' names, for messages; envs.py is their only reader.
ENV_POLICY = "VLLM_DSV4_WORKSPACE"
ENV_DEBUG = "VLLM_DSV4_WORKSPACE_DEBUG"
DEFAULT_POLICY = "shared"
GIB = 1 << 30


def resolve_policy(policy: str) -> str:
    """``policy``, checked against :data:`POLICIES` (the setting itself is
    read by :mod:`vllm_dsv4_backend.envs` and passed in by the layer core).

    Raises:
        ValueError: an unknown ``policy``.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    return policy


class WorkspaceManager:
    """Preallocated, per-layer, stream-fenced workspace (see module docstring).

    Args:
        config: sizing inputs (``WorkspaceConfig``).
        layers: ``(name, kind)`` per attention layer (a kind of
            ``config.kinds``); default ``("layers.{i}", k)`` for
            ``config.layer_kinds``. More can be added with ``add_layer``
            before ``reserve()``.
        policy: ``"shared"``, ``"private"`` or ``"off"`` (serving passes the
            ``VLLM_DSV4_WORKSPACE`` setting; see ``layer.core.make_workspace``).
        device: where the storage lives.
        streams: the ``StreamBackend``; default CUDA streams on CUDA devices,
            no streams on CPU; tests pass a ``SimStreamBackend``.
        debug: poison released regions and check overlaps (serving passes the
            ``VLLM_DSV4_WORKSPACE_DEBUG`` setting).
        shared_slots: slots per family and micro-batch under ``shared``
            (1 = least memory; 2 = ping-pong, so layer ``n+1``'s producer
            need not wait for layer ``n``'s consumer, at twice the memory).
        _unsafe_disable_fences_for_tests: skip every event wait (tests use it
            to prove the race test detects the #52836 corruption). Never set
            it anywhere else.
    """

    def __init__(
        self,
        config: WorkspaceConfig,
        layers: Sequence[tuple[str, int]] | None = None,
        *,
        policy: str = DEFAULT_POLICY,
        device: torch.device | str = "cpu",
        streams: StreamBackend | None = None,
        debug: bool = False,
        shared_slots: int = 1,
        _unsafe_disable_fences_for_tests: bool = False,
    ) -> None:
        if not isinstance(config, WorkspaceConfig):
            raise ValueError(f"config: expected a WorkspaceConfig, got {type(config).__name__}")
        self.config = config
        self.policy = resolve_policy(policy)
        self.debug = bool(debug)
        self.device = torch.device(device)
        self._backend: StreamBackend = streams if streams is not None \
            else default_backend(self.device)
        if not isinstance(shared_slots, int) or shared_slots < 1:
            raise ValueError(f"shared_slots: expected a positive int, got {shared_slots!r}")
        self.shared_slots = shared_slots
        self._fences_enabled = not _unsafe_disable_fences_for_tests
        self._layers: dict[str, Any] = {}
        if layers is None:
            layers = [(f"layers.{i}", k) for i, k in enumerate(config.layer_kinds)]
        for name, kind in layers:
            self.add_layer(name, kind)

        self._reserved = False
        self._storage: torch.Tensor | None = None
        self._layout: Layout | None = None
        self._slots: list[_Slot] = []
        # (layer, family, ubatch) -> _Slot, or the family's specs under "off".
        self._lookup: dict[tuple[str, str, int], Any] = {}
        self._live: list[Lease] = []  # debug only

        # The live counters' running totals, by name (live.LIVE_COUNTERS).
        self._totals: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._leased_bytes = 0
        self._peak_leased_bytes = 0
        self._live_counters = LiveCounters()

    # --- setup ----------------------------------------------------------------------

    def add_layer(self, name: str, kind: Any) -> None:
        """Register an attention layer of ``kind`` (a key of ``config.kinds``),
        before ``reserve()``."""
        if getattr(self, "_reserved", False):
            raise WorkspaceLeaseError(
                f"add_layer({name!r}): the workspace is already reserved; register every "
                "layer before reserve()"
            )
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty str, got {name!r}")
        self.config.check_kind(kind)
        if name in self._layers:
            raise ValueError(f"name: layer {name!r} is already registered")
        self._layers[name] = kind

    @property
    def layers(self) -> dict[str, Any]:
        """Registered layers: name -> kind."""
        return dict(self._layers)

    @property
    def backend(self) -> StreamBackend:
        return self._backend

    def layer_families(self, layer_name: str) -> tuple[str, ...]:
        """Families ``layer_name`` may lease."""
        if layer_name not in self._layers:
            raise ValueError(f"layer_name: {layer_name!r} is not a registered layer")
        return self.config.layer_families(self._layers[layer_name])

    def _plan_layout(self) -> Layout:
        return plan_layout(
            self.config, list(self._layers.values()), self.policy, self.shared_slots
        )

    def reserve(self, budget_bytes: int | None = None) -> None:
        """Allocate all storage now (at model load, before memory profiling).

        Idempotent. Under ``off`` nothing is allocated.

        Args:
            budget_bytes: the most bytes the ``private`` policy may reserve
                (``budget.reserve_budget_bytes``: on CUDA what vLLM's
                ``gpu_memory_utilization`` share leaves after the weights, on
                CPU the available memory); ``None``: no check. ``private``
                beyond it raises ``WorkspaceBudgetError`` (a ``ValueError``)
                before anything is allocated. ``shared`` (a few slots for all
                layers) and ``off`` are not checked.
        """
        if self._reserved:
            return
        layout = self._plan_layout()
        if budget_bytes is not None:
            self._check_budget(layout, budget_bytes)
        self._layout = layout
        if layout.total_bytes:
            self._storage = torch.empty(layout.total_bytes, dtype=torch.uint8, device=self.device)
        poison_stream = None
        if self.debug and self._storage is not None:
            # The fill is the first user of every slot: fence the first leases behind it.
            poison_stream = self._backend.current_stream()
            storage = self._storage
            self._backend.launch(poison_stream, lambda: storage.fill_(0xFF))
        by_key: dict[tuple[int, str, int], _Slot] = {}
        for s in layout.slots:
            bufs = tuple((spec, s.offset + off)
                         for spec, off in self.config.view_offsets(s.family))
            slot = _Slot(s.ubatch, s.family, s.index, s.offset, s.nbytes, bufs)
            if poison_stream is not None:
                slot.last_streams = (poison_stream,)
            self._slots.append(slot)
            by_key[(s.ubatch, s.family, s.index)] = slot
        names = list(self._layers)
        for (li, fam), idx in layout.slot_of.items():
            for u in range(self.config.num_ubatches):
                if self.policy == "off":
                    self._lookup[(names[li], fam, u)] = self.config.family_buffers(fam)
                else:
                    self._lookup[(names[li], fam, u)] = by_key[(u, fam, idx)]
        self._reserved = True

    def _check_budget(self, layout: Layout, budget_bytes: int) -> None:
        if type(budget_bytes) is not int or budget_bytes < 0:
            raise ValueError(
                f"budget_bytes: expected a non-negative int or None, got {budget_bytes!r}"
            )
        if self.policy != "private" or layout.total_bytes <= budget_bytes:
            return
        cfg = self.config
        ratios = list(self._layers.values())
        per_kind: dict[str, tuple[int, int]] = {}  # label -> (bytes per layer, layers)
        for r in ratios:
            label = cfg.kind_label(r)
            nbytes = sum(cfg.slot_bytes(f) for f in cfg.layer_families(r)) * cfg.num_ubatches
            per_kind[label] = (nbytes, per_kind.get(label, (0, 0))[1] + 1)
        per_layer = ", ".join(
            f"{k} {b} bytes ({b / GIB:.2f} GiB) x {n}"
            for k, (b, n) in sorted(per_kind.items(), key=lambda kv: -kv[1][0])
        )
        shared = plan_layout(cfg, ratios, "shared", 1).total_bytes
        fit = private_fit_tokens(cfg, ratios, budget_bytes)
        lower = (
            f"lower --max-num-batched-tokens (private fits at <= {fit} tokens)"
            if fit else "lower --max-num-batched-tokens (private does not fit even at 1 token)"
        )
        raise WorkspaceBudgetError(
            f"{ENV_POLICY}=private needs {layout.total_bytes} bytes "
            f"({layout.total_bytes / GIB:.2f} GiB) for {len(ratios)} layers x "
            f"{cfg.num_ubatches} micro-batch(es) at max_num_batched_tokens="
            f"{cfg.max_num_batched_tokens} (per layer: {per_layer}), but the budget is "
            f"{budget_bytes} bytes ({budget_bytes / GIB:.2f} GiB). Use {ENV_POLICY}=shared "
            f"(the default: {shared} bytes, {shared / GIB:.2f} GiB) or {lower}; supported "
            f"policies: {POLICIES}"
        )

    @property
    def reserved(self) -> bool:
        return self._reserved

    @property
    def storage(self) -> torch.Tensor | None:
        """The single uint8 storage behind every slot (``None`` under ``off``)."""
        return self._storage

    # --- leases ---------------------------------------------------------------------

    def lease(
        self,
        layer_name: str,
        family: str,
        num_tokens: int,
        ubatch: int = 0,
        stream: Any = None,
    ) -> Lease:
        """Views of ``family`` for ``num_tokens`` tokens of ``layer_name``.

        ``stream`` is the producer's stream (default: the current stream); the
        manager makes it wait for the previous users of the memory first.
        Raises ``WorkspaceCapacityError`` (a ``ValueError``) beyond the
        reservation (``num_tokens > config.max_num_batched_tokens`` or
        ``ubatch >= config.num_ubatches``, see the module docstring for why
        that is vLLM's worst case), ``ValueError`` for an unknown layer or
        family, a negative or non-int ``ubatch`` or ``num_tokens``, and
        ``WorkspaceLeaseError`` if the slot is still leased (or, in debug
        mode, on byte overlap). A refused lease takes nothing.
        """
        if not self._reserved:
            raise WorkspaceLeaseError(
                "lease() before reserve(): reserve the workspace at model load so memory "
                "profiling sees it"
            )
        entry = self._lookup.get((layer_name, family, ubatch))
        if entry is None or type(ubatch) is not int:  # not 1.0 or True for 1
            self._raise_lookup_error(layer_name, family, ubatch, num_tokens)
        if type(num_tokens) is not int or not 0 <= num_tokens <= \
                self.config.max_num_batched_tokens:
            self._raise_tokens_error(layer_name, family, ubatch, num_tokens)
        backend = self._backend
        if stream is None:
            stream = backend.current_stream()
        key = backend.stream_key(stream)

        if self.policy == "off":
            specs: tuple[BufferSpec, ...] = entry
            views: dict[str, torch.Tensor] = {}
            with self._alloc_context(stream):
                for spec in specs:
                    views[spec.name] = torch.empty(
                        (num_tokens, *spec.per_token_shape), dtype=spec.dtype, device=self.device
                    )
            self._totals["allocations"] += len(specs)
            nbytes = sum(spec.nbytes(num_tokens) for spec in specs)
            lease = Lease(self, None, layer_name, family, num_tokens, ubatch, stream, key,
                          views, nbytes)
        else:
            slot: _Slot = entry
            if slot.holder is not None:
                h = slot.holder
                raise WorkspaceLeaseError(
                    f"workspace slot {slot.family}[{slot.index}] (ubatch {slot.ubatch}) is still "
                    f"leased by layer {h.layer_name!r}; release() it after its last consumer "
                    f"before layer {layer_name!r} takes it"
                )
            cached = slot.views.get(num_tokens)
            if cached is None:
                cached = self._make_views(slot, num_tokens)
            sviews, nbytes = cached
            lease = Lease(self, slot, layer_name, family, num_tokens, ubatch, stream, key,
                          sviews, nbytes)
            if self.debug:
                self._check_overlap(lease)
            self._fence(slot, stream, key)
            slot.holder = lease
            if self.debug:
                self._live.append(lease)

        self._totals["leases"] += 1
        self._leased_bytes += nbytes
        if self._leased_bytes > self._peak_leased_bytes:
            self._peak_leased_bytes = self._leased_bytes
        return lease

    @contextlib.contextmanager
    def _alloc_context(self, stream: Any) -> Iterator[None]:
        # The caching allocator ties a block to the stream it is allocated on
        # (CUDA streams: a CUDA device, or emulated ones over a CPU tensor).
        if self.device.type == "cuda" or isinstance(self._backend, CudaStreamBackend):
            with torch.cuda.stream(stream):
                yield
        else:
            yield

    def _fence(self, slot: _Slot, stream: Any, key: Any) -> None:
        last = slot.last_streams
        if not last:
            return
        backend = self._backend
        for s in last:
            k = backend.stream_key(s)
            if k == key:
                continue  # same FIFO queue: already ordered after the old users
            if not self._fences_enabled:
                continue
            ev = slot.events.get(k)
            if ev is None:
                ev = slot.events[k] = backend.new_event()
            backend.record(ev, s)
            backend.wait(stream, ev)
            self._totals["fence_waits"] += 1
        slot.last_streams = ()

    def _make_views(
        self, slot: _Slot, num_tokens: int
    ) -> tuple[Mapping[str, torch.Tensor], int]:
        assert self._storage is not None
        views: dict[str, torch.Tensor] = {}
        total = 0
        for spec, off in slot.buffers:
            n = spec.nbytes(num_tokens)
            total += n
            try:
                views[spec.name] = (
                    self._storage[off : off + n]
                    .view(spec.dtype)
                    .view(num_tokens, *spec.per_token_shape)
                )
            except RuntimeError as e:
                # Built once per slot and token count; a byte range that does not
                # hold the tokens asked for is the workspace's bug, named here.
                raise WorkspaceLeaseError(
                    f"workspace view {slot.family}.{spec.name} (slot {slot.index}): bytes "
                    f"[{off}, {off + n}) do not hold {num_tokens} tokens of "
                    f"{list(spec.per_token_shape)} {spec.dtype}: {e}"
                ) from e
        entry = (types.MappingProxyType(views), total)
        slot.views[num_tokens] = entry
        return entry

    def _byte_ranges(self, lease: Lease) -> list[tuple[int, int]]:
        assert lease._slot is not None
        return [(off, off + spec.nbytes(lease.num_tokens)) for spec, off in lease._slot.buffers]

    def _check_overlap(self, lease: Lease) -> None:
        mine = self._byte_ranges(lease)
        for other in self._live:
            for a0, a1 in mine:
                for b0, b1 in self._byte_ranges(other):
                    if a0 < b1 and b0 < a1:
                        raise WorkspaceLeaseError(
                            f"overlapping leases: layer {lease.layer_name!r} {lease.family!r} "
                            f"(ubatch {lease.ubatch}) bytes [{a0}, {a1}) overlap live layer "
                            f"{other.layer_name!r} {other.family!r} (ubatch {other.ubatch}) "
                            f"bytes [{b0}, {b1})"
                        )

    def _release(self, lease: Lease) -> None:
        if not lease.active:
            raise WorkspaceLeaseError(f"{lease!r} released twice")
        lease.active = False
        slot = lease._slot
        backend = self._backend
        if slot is None:  # "off": the allocator must know every consumer stream
            for s in lease._streams[1:]:
                for v in lease.views.values():
                    backend.record_stream(v, s)
        else:
            if self.debug:
                # Poison after every user, on the stream the release is issued
                # from: fence it behind the lease's streams, then fill there; the
                # slot's last user is then that stream. (At a graph capture's eager
                # break that stream is the one running the break: the fill stays
                # ordered with the break's own reads of the slot.)
                here = backend.current_stream()
                slot.last_streams = tuple(lease._streams)
                self._fence(slot, here, backend.stream_key(here))
                views = lease.views
                backend.launch(here, lambda: _poison(views))
                slot.last_streams = (here,)
                self._live.remove(lease)
            else:
                slot.last_streams = tuple(lease._streams)
            slot.holder = None
        self._leased_bytes -= lease.nbytes

    # --- errors ---------------------------------------------------------------------

    def _raise_lookup_error(
        self, layer_name: Any, family: Any, ubatch: Any, num_tokens: Any = None
    ) -> None:
        if layer_name not in self._layers:
            raise ValueError(f"layer_name: {layer_name!r} is not a registered layer")
        names = self.config.family_names
        if family not in names:
            raise ValueError(f"family: expected one of {names}, got {family!r}")
        kind = self._layers[layer_name]
        fams = self.config.layer_families(kind)
        if family not in fams:
            raise ValueError(
                f"family: layer {layer_name!r} ({self.config.kind_label(kind)}) has "
                f"no {family!r} workspace; its families are {fams}"
            )
        n = self.config.num_ubatches
        if type(ubatch) is int and ubatch >= n:
            # More micro-batches than were reserved: a capacity error, like too many tokens.
            if type(num_tokens) is not int or num_tokens < 0:
                raise ValueError(f"num_tokens: expected a non-negative int, got {num_tokens!r}")
            req = sum(s.nbytes(num_tokens) for s in self.config.family_buffers(family))
            per_ubatch = self._family_bytes_per_ubatch(family)
            raise WorkspaceCapacityError(
                f"workspace family {family!r} of layer {layer_name!r} (ubatch {ubatch}, policy "
                f"{self.policy!r}): requested {num_tokens} tokens = {req} bytes for micro-batch "
                f"{ubatch}, reserved 0 bytes for it: micro-batches [0, {n}) were reserved "
                f"(WorkspaceConfig.num_ubatches={n}), {per_ubatch} bytes of {family!r} each. "
                "The workspace never grows after load: build it with num_ubatches = vLLM's "
                "parallel_config.num_ubatches (2 with --enable-dbo, --ubatch-size otherwise)"
            )
        raise ValueError(
            f"ubatch: expected an int in [0, {n}) (WorkspaceConfig.num_ubatches), got {ubatch!r}"
        )

    def _family_bytes_per_ubatch(self, family: str) -> int:
        """Reserved bytes of ``family`` in one micro-batch (0 under ``off``)."""
        if self._layout is None:
            return 0
        return sum(s.nbytes for s in self._layout.slots if s.family == family and s.ubatch == 0)

    def _raise_tokens_error(
        self, layer_name: str, family: str, ubatch: int, num_tokens: Any
    ) -> None:
        if type(num_tokens) is not int or num_tokens < 0:
            raise ValueError(f"num_tokens: expected a non-negative int, got {num_tokens!r}")
        specs = self.config.family_buffers(family)
        req = sum(s.nbytes(num_tokens) for s in specs)
        cap = self.config.max_num_batched_tokens
        res = sum(s.nbytes(cap) for s in specs)
        if self.policy == "off":
            held = (f"reserved {cap} tokens = {res} bytes (the bound; policy 'off' reserves "
                    "nothing but keeps it)")
        else:
            held = (f"reserved {cap} tokens = {res} bytes (a {self.config.slot_bytes(family)}"
                    "-byte slot)")
        raise WorkspaceCapacityError(
            f"workspace family {family!r} of layer {layer_name!r} (ubatch {ubatch}, policy "
            f"{self.policy!r}): requested {num_tokens} tokens = {req} bytes, {held}. A step "
            "carries at most max_num_batched_tokens tokens per micro-batch; the workspace "
            "never grows after load: raise max_num_batched_tokens "
            "(WorkspaceConfig.max_num_batched_tokens, vLLM --max-num-batched-tokens)"
        )

    # --- observability --------------------------------------------------------------

    # --- live counters of the served model steps ---------------------------------------

    @property
    def first_layer(self) -> str | None:
        """The first registered layer's name (``None`` before any)."""
        return next(iter(self._layers), None)

    def count_fallback(self, layer_name: str, family: str) -> None:
        """A layer let its own code allocate a buffer of ``family`` because the
        workspace could not serve it (e.g. a shape the reservation does not
        cover); counted in :meth:`live_stats` as ``fallbacks``, so the served
        log line shows every buffer that bypassed the workspace."""
        if layer_name not in self._layers:
            raise ValueError(f"layer_name: {layer_name!r} is not a registered layer")
        self._totals["fallbacks"] += 1

    def model_step(self) -> int:
        """A served model step begins (the layer core calls this at each
        forward of :attr:`first_layer` for micro-batch 0). Returns the number
        of model steps so far (see :meth:`live_stats`)."""
        return self._live_counters.tick(self._totals)

    def live_stats(self) -> dict[str, Any]:
        """Served model steps (``steps``), and leases, allocations the manager
        made for leased families (0 unless ``off``), fence waits and the
        layers' fallbacks to their own allocation (:meth:`count_fallback`)
        since the first: ``<name>_total``, ``<name>_per_step``,
        ``<name>_max_per_step`` (``leases`` / ``allocations`` /
        ``fence_waits`` / ``fallbacks``); with
        ``reserved_bytes_total`` and ``peak_leased_bytes``."""
        out = self._live_counters.snapshot(self._totals)
        out["reserved_bytes_total"] = 0 if self._layout is None else self._layout.total_bytes
        out["peak_leased_bytes"] = self._peak_leased_bytes
        return out

    def live_summary(self, label: str) -> str:
        """One log line of :meth:`live_stats` (``label``: e.g. the platform)."""
        live = self.live_stats()
        return format_summary(label, live, policy=self.policy,
                              reserved_bytes=live["reserved_bytes_total"],
                              peak_leased_bytes=live["peak_leased_bytes"])

    def reserved_bytes_per_family(self) -> dict[str, int]:
        per = dict.fromkeys(self.config.family_names, 0)
        for s in self._slots:
            per[s.family] += s.nbytes
        return per

    def reserved_bytes_per_layer(self) -> dict[str, int]:
        """Bytes each layer can lease (all micro-batches); under ``shared`` the
        slots are common to many layers, so these do not add up to the total."""
        out = dict.fromkeys(self._layers, 0)
        if self.policy == "off" or not self._reserved:
            return out
        for (name, _fam, _u), slot in self._lookup.items():
            out[name] += slot.nbytes
        return out

    def stats(self) -> dict[str, Any]:
        """Counters; the keys are stable (documented in docs/workspace.md).

        ``policy``, ``debug``, ``fences_enabled``, ``device``, ``num_ubatches``,
        ``max_num_batched_tokens``, ``shared_slots``, ``num_layers``,
        ``reserved`` (bool), ``reserved_bytes_total``,
        ``reserved_bytes_per_family`` {family: bytes},
        ``reserved_bytes_per_layer`` {layer: bytes it can lease},
        ``num_slots``, ``leases_total``, ``leased_bytes_now``,
        ``peak_leased_bytes``, ``fence_waits_total``, ``allocations_total``
        (tensors the manager allocated after ``reserve()``: 0 unless ``off``).
        Per served model step: :meth:`live_stats`.
        """
        return {
            "policy": self.policy,
            "debug": self.debug,
            "fences_enabled": self._fences_enabled,
            "device": str(self.device),
            "num_ubatches": self.config.num_ubatches,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "shared_slots": self.shared_slots,
            "num_layers": len(self._layers),
            "reserved": self._reserved,
            "reserved_bytes_total": 0 if self._layout is None else self._layout.total_bytes,
            "reserved_bytes_per_family": self.reserved_bytes_per_family(),
            "reserved_bytes_per_layer": self.reserved_bytes_per_layer(),
            "num_slots": len(self._slots),
            "leases_total": self._totals["leases"],
            "leased_bytes_now": self._leased_bytes,
            "peak_leased_bytes": self._peak_leased_bytes,
            "fence_waits_total": self._totals["fence_waits"],
            "allocations_total": self._totals["allocations"],
        }

    def __repr__(self) -> str:
        return (
            f"WorkspaceManager(policy={self.policy!r}, layers={len(self._layers)}, "
            f"reserved={self._reserved}, bytes="
            f"{0 if self._layout is None else self._layout.total_bytes})"
        )
