# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The workspace's live figures on ``vllm serve``'s own ``/metrics``.

vLLM's ``/metrics`` is served by the API server process from
``prometheus_client``'s registry (``vllm.v1.metrics.prometheus``), while the
workspace lives in the worker processes (engine core with the in-process
executor). vLLM itself moves figures across that boundary in two ways: the
engine core sends ``SchedulerStats`` to the front end with every output batch,
and with ``--api-server-count > 1`` ``prometheus_client``'s multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``, one memory-mapped file per process, summed by a
collector at scrape time). Neither carries plugin data without patching vLLM's
output path, so the plugin does what the multiprocess mode does, on its own
directory:

* the **front end** (role ``frontend``: the API server or ``LLM`` process,
  where ``register()`` runs before any engine process is started) creates a
  fresh directory, puts it in ``VLLM_DSV4_METRICS_DIR`` (inherited by the
  engine-core and worker processes it starts, as ``PROMETHEUS_MULTIPROC_DIR``
  is) and registers one :class:`WorkspaceCollector` with
  ``prometheus_client.REGISTRY``;
* each **process that reserves a workspace** (:class:`Publisher`, from
  :func:`vllm_dsv4_backend.layer.core.reserve_and_report`) writes
  ``<dir>/ws-<pid>-<n>.json`` once (labels, reserved bytes per family, layers
  per kind, policy) and updates ``<dir>/ws-<pid>-<n>.bin`` (little-endian
  int64 :data:`FIELDS`: model steps, the workspace's live counters (leases,
  allocations in leased families, fence waits, fallbacks), peak leased bytes,
  reserved bytes) in place after
  each model step's last attention layer (an 8-byte-aligned ``pack_into``
  into a shared mapping: no system call per step);
* at each scrape the collector reads every file pair of a live process and
  sums by ``(model_name, engine, rank)``.

Series (Prometheus conventions: base units, ``_total`` counters; nothing per
request), labels ``model_name``, ``engine`` (the data-parallel rank, as vLLM's
own series), ``rank`` (the worker's global rank in its engine: TP x PP) and
``family`` / ``kind``::

    vllm_dsv4_workspace_reserved_bytes{family}      gauge
    vllm_dsv4_workspace_layers{kind}                gauge (attention layers per kind)
    vllm_dsv4_workspace_model_steps_total           counter
    vllm_dsv4_workspace_leases_total                counter
    vllm_dsv4_workspace_leased_family_allocations_total   counter (0 unless policy off)
    vllm_dsv4_workspace_fence_waits_total           counter
    vllm_dsv4_workspace_fallbacks_total             counter
    vllm_dsv4_workspace_peak_leased_bytes           gauge
    vllm_dsv4_workspace_info{policy,platform}       gauge (1)

Counters count from the first model step (:meth:`WorkspaceManager.live_stats`).
``VLLM_DSV4_METRICS=0`` turns all of it off. With ``--api-server-count > 1`` (the
default under ``--data-parallel-size``) vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` and each
API server's ``/metrics`` is ``prometheus_client``'s multiprocess collector over that
directory (built per request by ``prometheus_fastapi_instrumentator``), which no custom
collector reaches: there each publisher also writes the same series as
``prometheus_client`` multiprocess metrics into that directory
(:class:`_MultiprocessSeries`), vLLM's own mechanism. Every failure here is one WARNING and the
figures stop; serving is never affected. Imports no vLLM.
"""

from __future__ import annotations

import atexit
import itertools
import json
import mmap
import multiprocessing
import os
import shutil
import struct
import tempfile
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from vllm_dsv4_backend import envs
from vllm_dsv4_backend._logging import init_logger
from vllm_dsv4_backend.workspace.live import COUNTERS, LIVE_COUNTERS

__all__ = ["PREFIX", "Publisher", "WorkspaceCollector", "labels_from_vllm_config",
           "publisher_for", "setup_frontend"]

logger = init_logger(__name__)

PREFIX = "vllm_dsv4_workspace"
ENV_DIR = "VLLM_DSV4_METRICS_DIR"
# The .bin record: the figures that move, in this order.
FIELDS: tuple[str, ...] = ("model_steps", *COUNTERS, "peak_leased_bytes", "reserved_bytes")
# The counter series: (figure, series name after PREFIX, help), the workspace's
# live counters (workspace.live.LIVE_COUNTERS) after the model steps.
COUNTER_SERIES: tuple[tuple[str, str, str], ...] = (
    ("model_steps", "model_steps", "Model steps served since the first"),
    *((c.name, c.series, c.doc) for c in LIVE_COUNTERS),
)
_FMT = "<" + "q" * len(FIELDS)
_SIZE = struct.calcsize(_FMT)

_lock = threading.Lock()
_frontend: dict[str, Any] = {}
_seq = itertools.count()


# --- the front end: one directory, one collector --------------------------------------


def setup_frontend() -> str | None:
    """In the front-end process: a fresh directory name for this server's processes
    (always new, so a server started from a process that ran the plugin does not
    share its parent's), exported as ``VLLM_DSV4_METRICS_DIR``, and the collector
    registered with ``prometheus_client.REGISTRY`` (once per process). Returns the
    directory, or ``None`` when off or ``prometheus_client`` is missing."""
    if not envs.VLLM_DSV4_METRICS:
        return None
    with _lock:
        if "dir" in _frontend:
            return _frontend["dir"]
        try:
            from prometheus_client import REGISTRY
        except ImportError:
            return None
        inherited = envs.VLLM_DSV4_METRICS_DIR
        if inherited is not None and multiprocessing.current_process().name.startswith(
                "ApiServer"):
            # One of several API servers (--api-server-count > 1, the default under DP):
            # the main process named the directory and started the engines with it.
            path = inherited
        else:
            # Named now, created by the first publisher (a front end whose engine never
            # reserves a workspace leaves nothing behind).
            path = os.path.join(tempfile.gettempdir(),
                                f"vllm_dsv4_metrics_{os.getpid()}_{uuid.uuid4().hex[:8]}")
            atexit.register(shutil.rmtree, path, True)
            os.environ[ENV_DIR] = path
        collector = WorkspaceCollector(path)
        REGISTRY.register(collector)
        _frontend.update(dir=path, collector=collector)
        return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_records(path: str) -> Iterator[tuple[dict[str, Any], dict[str, int]]]:
    """``(static, figures)`` of every publisher in ``path`` whose process lives."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return
    for name in names:
        if not (name.startswith("ws-") and name.endswith(".json")):
            continue
        stem = os.path.join(path, name[:-5])
        try:
            with open(stem + ".json", encoding="utf-8") as f:
                static = json.load(f)
            if not _pid_alive(int(static["pid"])):
                continue
            with open(stem + ".bin", "rb") as f:
                raw = f.read(_SIZE)
        except (OSError, ValueError, KeyError):
            continue
        if len(raw) != _SIZE:
            continue
        yield static, dict(zip(FIELDS, struct.unpack(_FMT, raw), strict=True))


class WorkspaceCollector:
    """A ``prometheus_client`` custom collector over a metrics directory."""

    def __init__(self, path: str) -> None:
        self.path = path

    def describe(self) -> list[Any]:
        return []  # no describe-time collect (the registry would read the files at register)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        base = ["model_name", "engine", "rank"]
        g = {
            "reserved": GaugeMetricFamily(
                f"{PREFIX}_reserved_bytes",
                "Bytes the DeepSeek-V4 workspace reserved at load, per buffer family",
                labels=[*base, "family"]),
            "layers": GaugeMetricFamily(
                f"{PREFIX}_layers", "Attention layers leasing from the workspace, per kind",
                labels=[*base, "kind"]),
            "peak": GaugeMetricFamily(
                f"{PREFIX}_peak_leased_bytes", "Most workspace bytes leased at one time",
                labels=base),
            "info": GaugeMetricFamily(
                f"{PREFIX}_info", "Workspace policy and platform (value 1)",
                labels=[*base, "policy", "platform"]),
        }
        c = {name: CounterMetricFamily(f"{PREFIX}_{series}", doc, labels=base)
             for name, series, doc in COUNTER_SERIES}
        ranks: dict[tuple[str, ...], dict[str, Any]] = {}
        for static, figures in read_records(self.path):
            key = tuple(str(static.get(k, "")) for k in base)
            agg = ranks.setdefault(key, {"figures": dict.fromkeys(FIELDS, 0), "families": {},
                                         "kinds": {}, "info": set()})
            for k, v in figures.items():
                agg["figures"][k] = max(agg["figures"][k], v) if k == "model_steps" \
                    else agg["figures"][k] + v
            for fam, n in static.get("reserved_bytes_per_family", {}).items():
                agg["families"][fam] = agg["families"].get(fam, 0) + int(n)
            for kind, n in static.get("layers_per_kind", {}).items():
                agg["kinds"][kind] = agg["kinds"].get(kind, 0) + int(n)
            agg["info"].add((str(static.get("policy", "")), str(static.get("platform", ""))))
        for key, agg in sorted(ranks.items()):
            labels = list(key)
            for fam, n in agg["families"].items():
                g["reserved"].add_metric([*labels, fam], n)
            for kind, n in agg["kinds"].items():
                g["layers"].add_metric([*labels, kind], n)
            g["peak"].add_metric(labels, agg["figures"]["peak_leased_bytes"])
            for policy, platform in sorted(agg["info"]):
                g["info"].add_metric([*labels, policy, platform], 1)
            for name, fam in c.items():
                fam.add_metric(labels, agg["figures"][name])
        yield from g.values()
        yield from c.values()


# --- a worker: one publisher per reserved workspace ------------------------------------


def labels_from_vllm_config(vllm_config: Any) -> dict[str, str]:
    """``model_name``, ``engine`` (data-parallel rank) and ``rank`` (the worker's
    global rank in its engine) from vLLM's config, without importing vLLM."""
    model = getattr(vllm_config, "model_config", None)
    names = getattr(model, "served_model_name", None) or getattr(model, "model", "")
    name = names[0] if isinstance(names, list | tuple) and names else names
    par = getattr(vllm_config, "parallel_config", None)
    return {
        "model_name": str(name),
        "engine": str(int(getattr(par, "data_parallel_rank", 0) or 0)),
        "rank": str(int(getattr(par, "rank", 0) or 0)),
    }


class Publisher:
    """One workspace's figures in the metrics directory (see the module docstring)."""

    def __init__(self, path: str, workspace: Any, labels: dict[str, str], platform: str) -> None:
        self.workspace = workspace
        os.makedirs(path, mode=0o700, exist_ok=True)
        stem = os.path.join(path, f"ws-{os.getpid()}-{next(_seq)}")
        stats = workspace.stats()
        kinds: dict[str, int] = {}
        cfg = workspace.config
        for kind in workspace.layers.values():
            label = cfg.kind_label(kind)
            kinds[label] = kinds.get(label, 0) + 1
        static = {
            **labels, "pid": os.getpid(), "platform": platform, "policy": workspace.policy,
            "reserved_bytes_per_family": {k: int(v) for k, v in
                                          stats["reserved_bytes_per_family"].items()},
            "layers_per_kind": kinds,
        }
        with open(stem + ".bin", "wb") as f:
            f.write(b"\0" * _SIZE)
        with open(stem + ".bin", "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _SIZE)
        tmp = stem + ".json.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(static, f)
        os.replace(tmp, stem + ".json")  # last: the collector reads only complete pairs

        # Several API servers: vLLM's /metrics is then prometheus_client's multiprocess
        # collector over PROMETHEUS_MULTIPROC_DIR (prometheus_fastapi_instrumentator builds
        # it per request), which reads only that directory's files: the same figures there.
        self._mp = _MultiprocessSeries(static) if os.environ.get(
            "PROMETHEUS_MULTIPROC_DIR") else None
        self.publish()

    def publish(self) -> None:
        live = self.workspace.live_stats()
        struct.pack_into(_FMT, self._map, 0, live["steps"],
                         *(live[f"{name}_total"] for name in COUNTERS),
                         live["peak_leased_bytes"], live["reserved_bytes_total"])
        if self._mp is not None:
            self._mp.update(live)


# live_stats() key of each counter of the multiprocess series.
_LIVE_KEYS = {"model_steps": "steps", **{name: f"{name}_total" for name in COUNTERS}}


class _MultiprocessSeries:
    """The series as ``prometheus_client`` multiprocess metrics (files in
    ``PROMETHEUS_MULTIPROC_DIR``, one per metric type and process, as vLLM's own API
    servers write them): counters incremented by each step's growth, gauges set."""

    def __init__(self, static: dict[str, Any]) -> None:
        from prometheus_client import Counter, Gauge, values

        base = ("model_name", "engine", "rank")
        labels = [str(static.get(k, "")) for k in base]
        saved = values.ValueClass
        # A process forked before vLLM set PROMETHEUS_MULTIPROC_DIR chose the in-memory
        # value class at import: these metrics always write the multiprocess files.
        values.ValueClass = values.MultiProcessValue()
        try:
            self.counters = {
                name: Counter(f"{PREFIX}_{series}", doc, labelnames=base,
                              registry=None).labels(*labels)
                for name, series, doc in COUNTER_SERIES}
            reserved = Gauge(f"{PREFIX}_reserved_bytes", "Bytes the DeepSeek-V4 workspace "
                             "reserved at load, per buffer family", labelnames=(*base, "family"),
                             registry=None, multiprocess_mode="livesum")
            for fam, n in static.get("reserved_bytes_per_family", {}).items():
                reserved.labels(*labels, fam).set(int(n))
            layers = Gauge(f"{PREFIX}_layers", "Attention layers leasing from the workspace, "
                           "per kind", labelnames=(*base, "kind"), registry=None,
                           multiprocess_mode="livesum")
            for kind, n in static.get("layers_per_kind", {}).items():
                layers.labels(*labels, kind).set(int(n))
            Gauge(f"{PREFIX}_info", "Workspace policy and platform (value 1)",
                  labelnames=(*base, "policy", "platform"), registry=None,
                  multiprocess_mode="livemax").labels(
                *labels, str(static.get("policy", "")), str(static.get("platform", ""))).set(1)
            self.peak = Gauge(f"{PREFIX}_peak_leased_bytes", "Most workspace bytes leased at "
                              "one time", labelnames=base, registry=None,
                              multiprocess_mode="livemax").labels(*labels)
        finally:
            values.ValueClass = saved
        self.last = dict.fromkeys(self.counters, 0)

    def update(self, live: dict[str, Any]) -> None:
        for name, counter in self.counters.items():
            now = int(live[_LIVE_KEYS[name]])
            if now > self.last[name]:
                counter.inc(now - self.last[name])
                self.last[name] = now
        self.peak.set(int(live["peak_leased_bytes"]))


_failed: list[str] = []


def publisher_for(workspace: Any, labels: dict[str, str] | None, platform: str
                  ) -> Publisher | None:
    """A :class:`Publisher` for ``workspace`` where this process has a metrics
    directory (``None``: off, no front end of this plugin, or an error, logged once)."""
    path = envs.VLLM_DSV4_METRICS_DIR
    if path is None or not envs.VLLM_DSV4_METRICS or _failed:
        return None
    try:
        return Publisher(path, workspace, labels or {}, platform)
    except Exception as e:  # noqa: BLE001 - figures must never stop serving
        _failed.append(repr(e))
        logger.warning("vllm_dsv4_backend: workspace figures for /metrics are off in this "
                       "process (%s: %s)", type(e).__name__, e)
        return None


def safe_publish(publisher: Publisher) -> bool:
    """``publisher.publish()``; False (logged once) if it failed."""
    try:
        publisher.publish()
        return True
    except Exception as e:  # noqa: BLE001 - figures must never stop serving
        if not _failed:
            _failed.append(repr(e))
            logger.warning("vllm_dsv4_backend: workspace figures for /metrics stopped "
                           "(%s: %s)", type(e).__name__, e)
        return False
