# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The registry of the plugin's patches of vLLM: one entry per patch.

Each :class:`Patch` says why it exists, how it patches, the upstream code it
replaces and when it can be removed, and is applied through one mechanism
(:func:`apply`): checked hook point (signature), one idempotency marker
(:func:`hooks.mark_port`), a log line. A hook point that changed fails with
:class:`~vllm_dsv4_backend.vllm_compat.hooks.PatchError` naming the vLLM
version and symbol.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_dsv4_backend._logging import init_logger
from vllm_dsv4_backend.vllm_compat import hooks

__all__ = ["PATCHES", "Patch", "apply", "applied"]

logger = init_logger(__name__)


@dataclass(frozen=True)
class Patch:
    """One runtime patch of vLLM."""

    name: str
    why: str
    how: str
    upstream: str
    remove_when: str
    apply: Callable[[], bool]
    """Applies the patch; True if it changed something, False if already in place."""


_applied: list[str] = []


def _mxfp4_indexer_cache() -> bool:
    mla_indexer = importlib.import_module("vllm.v1.attention.backends.mla.indexer")
    dsv4_attention = importlib.import_module("vllm.models.deepseek_v4.attention")
    original = mla_indexer.dsa_indexer_uses_fp4
    if hooks.is_port(original):
        return False
    hooks.check_signature(
        "vllm.v1.attention.backends.mla.indexer.dsa_indexer_uses_fp4", original, ("vllm_config",)
    )
    hooks.resolve(dsv4_attention, "dsa_indexer_uses_fp4")

    def dsa_indexer_uses_fp4(vllm_config: Any) -> bool:
        if vllm_config.attention_config.resolve_indexer_kv_dtype("fp8") == "mxfp4":
            return True
        return original(vllm_config)

    dsa_indexer_uses_fp4.__vllm_dsv4_original__ = original  # type: ignore[attr-defined]
    port = hooks.mark_port(dsa_indexer_uses_fp4)
    mla_indexer.dsa_indexer_uses_fp4 = port
    dsv4_attention.dsa_indexer_uses_fp4 = port
    return True


PATCHES: dict[str, Patch] = {
    p.name: p
    for p in (
        Patch(
            name="mxfp4_indexer_cache",
            why="vLLM refuses indexer_kv_dtype='mxfp4' off Blackwell ('requires Blackwell "
            "datacenter GPUs') because its MXFP4 indexer kernels are DeepGEMM's; the "
            "plugin's CPU layer computes MXFP4 logits and stores in torch.",
            how="wraps dsa_indexer_uses_fp4 in vllm.v1.attention.backends.mla.indexer and "
            "its by-name import in vllm.models.deepseek_v4.attention: True for mxfp4, "
            "vLLM's answer otherwise (other validation stays vLLM's)",
            upstream="vllm/v1/attention/backends/mla/indexer.py: dsa_indexer_uses_fp4",
            remove_when="vLLM's CPU path supports the MXFP4 indexer cache",
            apply=_mxfp4_indexer_cache,
        ),
    )
}


def apply(name: str) -> bool:
    """Apply the registered patch ``name`` (idempotent); True if it changed vLLM."""
    patch = PATCHES.get(name)
    if patch is None:
        raise ValueError(f"patch: expected one of {sorted(PATCHES)}, got {name!r}")
    changed = patch.apply()
    if changed:
        _applied.append(name)
        logger.debug("vllm_dsv4_backend: applied patch %s (%s)", name, patch.how)
    return changed


def applied() -> list[str]:
    """Names of the patches this process applied, in order."""
    return list(_applied)
