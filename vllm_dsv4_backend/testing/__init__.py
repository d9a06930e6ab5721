# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Test support, kept apart from the serving code (torch only).

Everything here is inert unless a test setting of :mod:`vllm_dsv4_backend.envs`
turns it on:

* ``VLLM_DSV4_MARKER_DIR``: the layers record, from inside the worker, which
  kernel path each layer kind ran (``layers/layer-<kind>-<pid>.json``) and the
  workspace counters, rewritten once per model step
  (``layers/workspace-<pid>.json``), so the server tests can prove what ran.
* ``VLLM_DSV4_TEST_PERTURB_SINK``: shifts layer 0's attention sink after
  loading: the parity test's negative control (a comparison that cannot fail
  proves nothing).
* ``VLLM_DSV4_TEST_UNSAFE_NO_FENCES``: the workspace skips its cross-stream
  fences (the load and stream tests show what that breaks).
* ``VLLM_DSV4_TEST_ORACLE_FAULT``: C4 top-k entry ids off by one, or compressed
  entries visible one token late: the transformers oracle's negative controls
  (``tests/vllm/test_transformers_oracle.py``), each a one-off semantic error
  that a comparison against an independent model must catch; so are ``stale_kv``
  and ``alias49236``, and ``stale_kv`` is also the trained model's lm_eval gate
  control (``tests/vllm/test_lm_eval_trained.py``).
* :mod:`.schedule`: the simulated DeepSeek-V4 stream fan-out the race tests
  drive the workspace with.

The serving code calls only the hooks below; each returns at once when its
setting is off.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from typing import Any

import torch

from vllm_dsv4_backend import envs
from vllm_dsv4_backend._logging import init_logger

__all__ = [
    "after_layer_forward", "after_layer_loaded", "compress_lag", "fences_enabled",
    "note_compressor_scratch", "oracle_fault_topk", "oracle_fault_window", "record_layer",
]

logger = init_logger(__name__)

_WORKSPACE_MARKER_KEYS = (
    "policy", "fences_enabled", "num_layers", "reserved_bytes_total", "leases_total",
    "fence_waits_total", "allocations_total", "peak_leased_bytes",
)
_recorded_kinds: set[str] = set()
_steps = 0
_warned_no_fences = False


def fences_enabled() -> bool:
    """False only under ``VLLM_DSV4_TEST_UNSAFE_NO_FENCES=1`` (warned once)."""
    global _warned_no_fences
    if not envs.VLLM_DSV4_TEST_UNSAFE_NO_FENCES:
        return True
    if not _warned_no_fences:
        _warned_no_fences = True
        logger.warning("VLLM_DSV4_TEST_UNSAFE_NO_FENCES=1: the workspace skips its "
                       "cross-stream fences (test only)")
    return False


def _layers_dir() -> str | None:
    marker_dir = envs.VLLM_DSV4_MARKER_DIR
    if marker_dir is None:
        return None
    path = os.path.join(marker_dir, "layers")
    os.makedirs(path, exist_ok=True)
    return path


def _write_json(path: str, record: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def record_layer(layer: Any, kind: str, kernel_path: str) -> None:
    """Once per layer kind and process: what the plugin's layer ran."""
    if kind in _recorded_kinds:
        return
    out = _layers_dir()
    if out is None:
        return
    _recorded_kinds.add(kind)
    _write_json(os.path.join(out, f"layer-{kind}-{os.getpid()}.json"), {
        "pid": os.getpid(),
        "process": multiprocessing.current_process().name,
        "layer_kind": kind,
        "layer_cls": type(layer).__qualname__,
        "backend": layer.backend_cls.get_name(),
        "kernel_path": kernel_path,
        "workspace_policy": layer._workspace.policy,
        "indexer_kv_dtype": layer.indexer_kv_dtype,
    })


def after_layer_forward(layer: Any, workspace: Any) -> None:
    """After the model's last attention layer of a step: rewrite this
    process's workspace counters (once per step, not per layer)."""
    if envs.VLLM_DSV4_MARKER_DIR is None:
        return
    layers = workspace.layers
    if not layers or layer.prefix != next(reversed(layers)):
        return
    global _steps
    _steps += 1
    stats = workspace.stats()
    record = {k: stats[k] for k in _WORKSPACE_MARKER_KEYS}
    record.update(pid=os.getpid(), steps=_steps)
    out = _layers_dir()
    _write_json(os.path.join(out, f"workspace-{os.getpid()}.json"), record)


def after_layer_loaded(layer: Any) -> None:
    """Under ``VLLM_DSV4_TEST_PERTURB_SINK``: shift layer 0's sink."""
    delta = envs.VLLM_DSV4_TEST_PERTURB_SINK
    if delta is None or not layer.prefix.endswith("layers.0.attn"):
        return
    logger.warning("VLLM_DSV4_TEST_PERTURB_SINK=%s: shifting %s's sink (test only)", delta,
                   layer.prefix)
    layer.attn_sink.data += delta


def compress_lag() -> int:
    """Tokens by which compressed entries become visible late: 1 under
    ``VLLM_DSV4_TEST_ORACLE_FAULT=compress_late``, else 0 (the C128 table uses
    ``j < (p + 1 - lag) // ratio``)."""
    return 1 if envs.VLLM_DSV4_TEST_ORACLE_FAULT == "compress_late" else 0


_compressor_scratch: torch.Tensor | None = None


def note_compressor_scratch(kv_score: torch.Tensor) -> None:
    """Under ``VLLM_DSV4_TEST_ORACLE_FAULT=alias49236``: keep the C4 compressor's
    scratch (its fp32 kv/score projection) of the current layer step, the bytes
    #49236's pool put at the top-k table's offset (:func:`_alias_over_topk`)."""
    global _compressor_scratch
    if envs.VLLM_DSV4_TEST_ORACLE_FAULT == "alias49236":
        _compressor_scratch = kv_score


def oracle_fault_topk(topk: torch.Tensor, positions: torch.Tensor, ratio: int) -> None:
    """A C4 layer's local top-k table ``[T, index_topk]`` (entry ids, -1 pads)
    right before the sparse MLA reads it, under ``VLLM_DSV4_TEST_ORACLE_FAULT``:
    ``topk_off_by_one`` turns every id ``j`` into ``j - 1`` (each selected entry
    reads its predecessor; entry 0 becomes -1, invalid); ``compress_late`` drops
    every entry ``j >= p // ratio`` (the entry a token just completed);
    ``alias49236`` writes the layer's compressor scratch over the table, see
    :func:`_alias_over_topk`."""
    fault = envs.VLLM_DSV4_TEST_ORACLE_FAULT
    if fault in ("off", "stale_kv"):
        return
    if fault == "alias49236":
        _alias_over_topk(topk, _compressor_scratch)
        return
    if fault == "topk_off_by_one":
        topk.sub_((topk >= 0).to(topk.dtype))  # -1 pads stay -1; 0 -> -1
        return
    bound = torch.div(positions, ratio, rounding_mode="floor").to(topk.dtype).unsqueeze(-1)
    topk.masked_fill_(topk >= bound, -1)


def _alias_over_topk(topk: torch.Tensor, aliased: torch.Tensor | None) -> None:
    """vLLM #49236's pool put every aux family (indexer q, top-k ids, compressor
    scratch) at one offset, so on a GPU the compressor on the aux stream writes
    its scratch over the top-k table between the indexer's write and the sparse
    MLA's read. The CPU runs one stream, so the race cannot happen by itself:
    this writes the race's outcome, the scratch's bytes (the C4 kv/score
    projection, ``[T, 1024]`` fp32: more bytes than the table) read as int32
    entry ids. Ids
    outside ``[0, visible)`` (most of them: float bits) become -1, because the
    C++ sparse MLA does not bounds-check and would read outside the cache."""
    if aliased is None:
        return
    raw = aliased.detach().contiguous().view(-1).view(torch.uint8)
    n = min(topk.numel() * topk.element_size(), raw.numel())
    n -= n % 4
    ids = raw[:n].view(torch.int32).to(topk.dtype)
    visible = topk.max(dim=-1, keepdim=True).values + 1  # valid ids are 0 .. max
    flat = topk.view(-1)
    flat[: ids.numel()] = ids
    topk.masked_fill_((topk < 0) | (topk >= visible), -1)


def oracle_fault_window(window_slots: torch.Tensor, positions: torch.Tensor,
                        token_to_req: torch.Tensor) -> torch.Tensor:
    """The sliding-window slot table ``[T, W]`` the sparse MLA reads; under
    ``VLLM_DSV4_TEST_ORACLE_FAULT=stale_kv`` a copy without the rows the step
    itself wrote (positions at or after the first position of the token's
    request in this step): a read that ran before the step's KV insert landed
    sees whatever the slots held before, here treated as absent. A decode
    token loses its own row; a prefill loses its whole window. The table is
    shared by the layers of the step, so it is copied, never changed in place."""
    if envs.VLLM_DSV4_TEST_ORACLE_FAULT != "stale_kv":
        return window_slots
    req = token_to_req.to(torch.int64)
    n_req = int(req.max()) + 1 if req.numel() else 0
    start = torch.full((n_req,), torch.iinfo(torch.int64).max, dtype=torch.int64,
                       device=positions.device)
    start.scatter_reduce_(0, req, positions.to(torch.int64), reduce="amin")
    width = window_slots.shape[1]
    col = (positions.to(torch.int64) - (width - 1)).clamp(min=0).unsqueeze(-1)
    col = col + torch.arange(width, device=positions.device)
    return window_slots.masked_fill(col >= start[req].unsqueeze(-1), -1)
