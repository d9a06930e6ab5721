# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hook on vLLM's dummy weight loader for the ``vllm_dsv4_dummy_init`` marker.

``DummyModelLoader.load_weights(self, model, model_config)``
(``vllm/model_executor/model_loader/dummy_loader.py``) runs vLLM's own dummy
initialisation; the wrapper then re-initialises the model's parameters with
:mod:`.dummy_init` when ``model_config.hf_config`` carries the
marker (and ``VLLM_DSV4_DUMMY_INIT`` is not 0), through the parameters' own
weight loaders so every tensor-parallel size gets the same model. Models
without the marker are untouched. Runs before ``process_weights_after_loading``,
so CPU weight packing (``wo_a``'s ``bmm_cpu`` copy, the MoE repacking) sees the
new values. Registered as ``dummy_init_loader`` in :mod:`.patches`, which arms
:func:`install` on the import of :data:`LOADER_MODULE`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dsv4_backend import envs
from vllm_dsv4_backend._logging import init_logger
from vllm_dsv4_backend.vllm_compat import hooks

__all__ = ["LOADER_MODULE", "LOADER_SYMBOL", "install"]

logger = init_logger(__name__)

LOADER_MODULE = "vllm.model_executor.model_loader.dummy_loader"
LOADER_SYMBOL = "DummyModelLoader.load_weights"


def install(module: ModuleType, on_applied: Callable[[str], None]) -> bool:
    """Wrap ``DummyModelLoader.load_weights`` in ``module`` (checked signature,
    ``hooks.mark_port`` marker); False if already wrapped."""
    from vllm_dsv4_backend.vllm_compat import dummy_init

    owner, attr, original = hooks.resolve(module, LOADER_SYMBOL)
    if hooks.is_port(original):
        return False
    hooks.check_signature(f"{LOADER_MODULE}.{LOADER_SYMBOL}", original, ("model", "model_config"))

    def load_weights(self: Any, model: Any, model_config: Any) -> None:
        original(self, model, model_config)
        spec = dummy_init.spec_from_config(model_config.hf_config)
        if spec is None:
            return
        if not envs.VLLM_DSV4_DUMMY_INIT:
            logger.info("%s marker ignored: VLLM_DSV4_DUMMY_INIT=0", dummy_init.MARKER_KEY)
            return
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        hf = model_config.hf_config
        tp_rank = get_tensor_model_parallel_rank()
        tp_size = get_tensor_model_parallel_world_size()
        stats = dummy_init.init_model_(
            model, seed=spec.seed, tp_rank=tp_rank, tp_size=tp_size,
            num_heads=getattr(hf, "num_attention_heads", None),
            num_experts=getattr(hf, "n_routed_experts", None),
        )
        n = stats["loaded"] + stats["initialised"]
        logger.info(
            "dummy weights: %s (seed %d, TP rank %d/%d) on %d parameters (%d through their "
            "weight loaders; %d non-float left as loaded)",
            spec.kind, spec.seed, tp_rank, tp_size, n, stats["loaded"], stats["untouched"],
        )
        on_applied(f"dummy_init:{spec.kind}:seed={spec.seed}:{n}")

    load_weights.__wrapped__ = original  # type: ignore[attr-defined]
    hooks.replace_attr(owner, attr, load_weights)
    on_applied(f"loader:{LOADER_MODULE}.{LOADER_SYMBOL}")
    return True
