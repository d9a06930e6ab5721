# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Safety item 4: peak workspace memory no longer scales with the number of layers.

DeepSeek-V4-Flash widths (64 q heads padded to 64, MLA head dim 512, 64 x 128
lightning-indexer heads, top-k 512, FP4 indexer cache) at ``max_num_batched_tokens``
8192, one micro-batch, for models of 4, 43 (Flash) and 61 layers whose compress ratios
follow Flash's pattern (``0, 0`` then ``4, 128`` alternating):

* ``shared``: bytes the ``WorkspaceManager`` really reserves (``reserve()``, lazily
  committed CPU memory; ``stats()["reserved_bytes_total"]``): the same for every layer
  count, because the layers take the same slots in turn behind fences;
* ``private`` (one set of buffers per layer): the manager's own layout plan
  (``sizing.workspace_bytes``, what ``reserve()`` would allocate; 43 layers would be
  tens of GiB), linear in the number of C4/C128/SWA layers; reserved for real at 4 layers
  to tie the plan to the manager;
* vLLM #49236's pool (``layer.sizing.pool49236_bytes``): 548 MiB at 8192 tokens, as the
  issue says; constant too, but it bought that by aliasing the families (item 3).

The families are what the CUDA layer leases (its lease plan, ``layer.plan.LEASE_PLAN``,
through ``layer.plan``'s one builder, as serving builds it).
"""

from __future__ import annotations

from typing import Any

from vllm_dsv4_backend.layer.plan import (
    DSV4_FLASH_HF_CONFIG,
    build_workspace_config,
    dims_from_hf_config,
)
from vllm_dsv4_backend.layer.sizing import pool49236_bytes
from vllm_dsv4_backend.workspace import WorkspaceManager
from vllm_dsv4_backend.workspace.sizing import MIB, WorkspaceConfig, workspace_bytes

TOKENS = 8192
LAYER_COUNTS = (4, 43, 61)


def flash_ratios(num_layers: int) -> list[int]:
    """Flash's layer types for ``num_layers`` layers: ``[0, 0, 4, 128, 4, 128, ...]``."""
    return ([0, 0] + [4, 128] * num_layers)[:num_layers]


def config_of(hf: dict[str, Any]) -> WorkspaceConfig:
    dims, ratios = dims_from_hf_config(hf, tp_size=1)
    return build_workspace_config(dims, max_num_batched_tokens=TOKENS, indexer_kv_dtype="mxfp4",
                                  platform="cuda", compress_ratios=ratios)


def flash_config(num_layers: int) -> WorkspaceConfig:
    return config_of({**DSV4_FLASH_HF_CONFIG, "num_hidden_layers": num_layers,
                      "compress_ratios": flash_ratios(num_layers)})


def reserved(config: WorkspaceConfig, policy: str) -> int:
    mgr = WorkspaceManager(config, policy=policy, debug=False)
    mgr.reserve()
    total = int(mgr.stats()["reserved_bytes_total"])
    del mgr
    return total


def memory_rows() -> list[dict[str, Any]]:
    rows = []
    for n in LAYER_COUNTS:
        cfg = flash_config(n)
        assert cfg.layer_kinds == tuple(flash_ratios(n))
        rows.append({"layers": n, "shared": reserved(cfg, "shared"),
                     "private": workspace_bytes(cfg, "private").total,
                     "pool49236": pool49236_bytes(cfg)["total"]})
    return rows


def test_shared_is_constant_in_the_layer_count_private_is_linear(figures):
    rows = memory_rows()
    shared = {r["shared"] for r in rows}
    # The Flash config itself (43 layers + an MTP entry in compress_ratios) gives
    # the same config as our 43-layer one.
    flash = config_of(DSV4_FLASH_HF_CONFIG)
    assert flash == flash_config(43)

    # shared: one number, whatever the layer count; and it is the plan's number.
    assert len(shared) == 1, rows
    for r in rows:
        assert r["shared"] == workspace_bytes(flash_config(r["layers"]), "shared").total
    # private: the manager reserves what the plan says (4 layers, for real) ...
    assert reserved(flash_config(4), "private") == rows[0]["private"]
    # ... and it is linear: bytes = sum over layers of their families' slot bytes.
    for r in rows:
        cfg = flash_config(r["layers"])
        per_layer = sum(cfg.slot_bytes(f) for ratio in cfg.layer_kinds
                        for f in cfg.layer_families(ratio))
        assert r["private"] == per_layer
    assert rows[0]["private"] < rows[1]["private"] < rows[2]["private"]
    # #49236's pool at 8192 tokens: 548 MiB (padded q 512 MiB + the FP4 family 36 MiB).
    assert {r["pool49236"] for r in rows} == {548 * MIB}
    # shared costs the families' own bytes beside the pool (no aliasing), no more than
    # 1.1x it, and less than private from 4 layers up.
    assert rows[0]["shared"] <= 1.1 * rows[0]["pool49236"]
    assert rows[0]["shared"] < rows[0]["private"]

    def mib(b: int) -> str:
        return f"{b / MIB:,.0f}"

    figure = ("MiB reserved at T=8192 for 4 / 43 / 61 layers: shared "
              + " / ".join(mib(r["shared"]) for r in rows)
              + ", private " + " / ".join(mib(r["private"]) for r in rows)
              + ", #49236 pool " + " / ".join(mib(r["pool49236"]) for r in rows))
    figures.record(4, figure, {"tokens": TOKENS, "indexer": "mxfp4", "tp": 1, "rows": rows})
