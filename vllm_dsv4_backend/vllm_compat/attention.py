# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hook point for the DeepSeek-V4 attention layer class.

DeepSeek-V4 picks its attention *layer* class in the model, not through the
attention-backend registry (the layer's ``backend_cls`` then supplies the
metadata builder), so serving ``FLASHMLA_SPARSE_DSV4`` with the plugin means
swapping that class:

* **CPU** (vLLM 0.32 ``vllm/models/deepseek_v4/cpu/model.py``):
  ``DeepseekV4DecoderLayer.__init__`` instantiates the module global
  ``DeepseekV4CPUAttention`` (imported by name from ``cpu/cpu_sparse.py``)
  at call time, so rebinding that global before the model is built swaps the
  layer for every decoder layer. The replacement must subclass vLLM's
  ``DeepseekV4Attention`` (normally ``DeepseekV4CPUAttention`` itself):
  building the stock layer and swapping ``self.attn`` afterwards fails with
  "Duplicate layer name".
* **CUDA** (vLLM 0.33 ``vllm/models/deepseek_v4/nvidia/model.py``):
  ``_select_dsv4_attn_cls(vllm_config)`` maps ``attention_config.backend`` to a
  layer class; it is wrapped to return the plugin's class when the backend is
  ``FLASHMLA_SPARSE_DSV4`` (or ``CUSTOM``) and to defer to vLLM otherwise.

:func:`install_attention_layer` arms the swap for when vLLM imports the model
module (the class is usually resolved lazily, because it subclasses vLLM
layers whose import is heavy). The plugin's ``register()`` calls it when
``VLLM_DSV4_ATTN_IMPL`` selects the plugin layer, taking the class from
``vllm_dsv4_backend.layer.get_attention_layer_cls(platform: str) -> type``
(:data:`LAYER_MODULE`, :data:`LAYER_FACTORY`); ``VLLM_DSV4_ATTN_IMPL=vllm``
leaves vLLM's own layer in place.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dsv4_backend._logging import init_logger
from vllm_dsv4_backend.vllm_compat import hooks

logger = init_logger(__name__)

__all__ = [
    "CPU_MODULE",
    "CPU_SYMBOL",
    "CUDA_MODULE",
    "CUDA_SYMBOL",
    "LAYER_FACTORY",
    "LAYER_MODULE",
    "find_plugin_layer",
    "install_attention_layer",
    "installed_attention_layer",
]

CPU_MODULE = "vllm.models.deepseek_v4.cpu.model"
CPU_SYMBOL = "DeepseekV4CPUAttention"
CUDA_MODULE = "vllm.models.deepseek_v4.nvidia.model"
CUDA_SYMBOL = "_select_dsv4_attn_cls"
LAYER_MODULE = "vllm_dsv4_backend.layer"
LAYER_FACTORY = "get_attention_layer_cls"
# attention_config.backend names for which the CUDA selector returns our class.
CUDA_BACKENDS = ("FLASHMLA_SPARSE_DSV4", "CUSTOM")

_installed: dict[str, Any] = {}


def installed_attention_layer() -> type | None:
    """The layer class installed in this process so far (None: vLLM's own)."""
    return _installed.get("cls")


def find_plugin_layer(platform: str) -> Callable[[], type] | None:
    """Lazy factory for the plugin's layer class, or None if none is shipped.

    Looks for :data:`LAYER_MODULE` without importing it (it imports vLLM's
    DeepSeek-V4 modules); the returned callable imports it and calls
    ``get_attention_layer_cls(platform)``.
    """
    if importlib.util.find_spec(LAYER_MODULE) is None:
        return None

    def factory() -> type:
        module = importlib.import_module(LAYER_MODULE)
        get_cls = getattr(module, LAYER_FACTORY, None)
        if not callable(get_cls):
            raise RuntimeError(
                f"{LAYER_MODULE} must define {LAYER_FACTORY}(platform: str) -> type "
                "to provide the plugin's DeepSeek-V4 attention layer"
            )
        return get_cls(platform)

    return factory


def _check_layer_cls(cls: Any) -> type:
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention

    if not (isinstance(cls, type) and issubclass(cls, DeepseekV4Attention)):
        raise hooks.fail(
            "attention layer",
            f"{cls!r} is not a subclass of vllm.models.deepseek_v4.attention.DeepseekV4Attention",
        )
    return cls


def _register_backend_of(cls: type) -> None:
    """Point FLASHMLA_SPARSE_DSV4 in the registry at the layer's backend class."""
    backend_cls = getattr(cls, "backend_cls", None)
    if backend_cls is None or backend_cls.__module__.startswith("vllm."):
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(
        AttentionBackendEnum.FLASHMLA_SPARSE_DSV4,
        f"{backend_cls.__module__}.{backend_cls.__qualname__}",
    )


def install_attention_layer(
    cls: type | Callable[[], type],
    *,
    platform: str,
    on_applied: Callable[[str], None] | None = None,
    optional: bool = False,
) -> None:
    """Make DeepSeek-V4 build ``cls`` as its attention layer in this process.

    Args:
        cls: the layer class (a ``DeepseekV4Attention`` subclass), or a
            zero-argument callable returning it, resolved only when vLLM
            imports the model module.
        platform: ``"cpu"`` (rebinds ``cpu.model.DeepseekV4CPUAttention``) or
            ``"cuda"`` (wraps ``nvidia.model._select_dsv4_attn_cls``).
        on_applied: called with a description once the swap is in place.
        optional: if resolving ``cls`` raises ``NotImplementedError`` (the
            provider has no layer for this platform), keep vLLM's layer and
            log a warning instead of failing (``VLLM_DSV4_ATTN_IMPL=auto``).

    Raises:
        ValueError: unknown ``platform``.
        PatchError: (when the model module is imported) the hook point is
            missing or ``cls`` is not a ``DeepseekV4Attention`` subclass.
    """
    if platform not in ("cpu", "cuda"):
        raise ValueError(f"platform: expected 'cpu' or 'cuda', got {platform!r}")
    factory = cls if not isinstance(cls, type) else (lambda: cls)

    def resolve() -> type | None:
        try:
            return factory()
        except NotImplementedError as e:
            if not optional:
                raise
            logger.warning("keeping vLLM's DeepSeek-V4 attention layer: %s", e)
            if on_applied:
                on_applied(f"attention:vllm (plugin layer unavailable: {e})")
            return None

    def install_cpu(module: ModuleType) -> None:
        owner, attr, current = hooks.resolve(module, CPU_SYMBOL)
        if not isinstance(current, type):
            raise hooks.fail(f"{CPU_MODULE}.{CPU_SYMBOL}", f"is {current!r}, not a class")
        resolved = resolve()
        if resolved is None:
            return
        layer = _check_layer_cls(resolved)
        if current is not layer:
            setattr(owner, attr, layer)
        _installed["cls"] = layer
        _register_backend_of(layer)
        if on_applied:
            on_applied(f"attention:{CPU_MODULE}.{CPU_SYMBOL}={layer.__qualname__}")

    def install_cuda(module: ModuleType) -> None:
        _, _, original = hooks.resolve(module, CUDA_SYMBOL)
        if hooks.is_port(original):
            original = original.__vllm_dsv4_original__
        else:
            hooks.check_signature(f"{CUDA_MODULE}.{CUDA_SYMBOL}", original, ("vllm_config",))
        resolved = resolve()
        if resolved is None:
            return
        layer = _check_layer_cls(resolved)

        def _select_dsv4_attn_cls(vllm_config: Any) -> type:
            backend = vllm_config.attention_config.backend
            if backend is not None and getattr(backend, "name", None) in CUDA_BACKENDS:
                return layer
            return original(vllm_config)

        _select_dsv4_attn_cls.__vllm_dsv4_original__ = original  # type: ignore[attr-defined]
        setattr(module, CUDA_SYMBOL, hooks.mark_port(_select_dsv4_attn_cls))
        _installed["cls"] = layer
        _register_backend_of(layer)
        if on_applied:
            on_applied(f"attention:{CUDA_MODULE}.{CUDA_SYMBOL}->{layer.__qualname__}")

    if platform == "cpu":
        hooks.when_imported(CPU_MODULE, install_cpu)
    else:
        hooks.when_imported(CUDA_MODULE, install_cuda)
