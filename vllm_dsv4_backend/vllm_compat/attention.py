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
  ``DeepseekV4DecoderLayer.__init__`` calls ``_select_dsv4_attn_cls(vllm_config)``,
  which returns the module global ``DeepseekV4FlashMLAAttention`` (read at call
  time) for ``FLASHMLA_SPARSE_DSV4`` / ``FLASHMLA_SPARSE`` and for the default
  non-SM12 path; the main model, MTP and DSpark all build through that decoder
  layer. That global is rebound to the plugin's subclass (FlashInfer and SM12
  choices stay vLLM's). Only on vLLM 0.33.x and 0.34.x, after :func:`check_cuda_hook_points`;
  a hook point that differs keeps vLLM's layer with an error log (fail closed),
  or raises under ``VLLM_DSV4_ATTN_IMPL=plugin``.

:func:`install_attention_layer` arms the swap for when vLLM imports the model
module (the class is usually resolved lazily, because it subclasses vLLM
layers whose import is heavy). The plugin's ``register()`` calls it when
``VLLM_DSV4_ATTN_IMPL`` selects the plugin layer, taking the class from
``vllm_dsv4_backend.layer.get_attention_layer_cls(platform: str) -> type``
(:data:`LAYER_MODULE`); ``VLLM_DSV4_ATTN_IMPL=vllm``
leaves vLLM's own layer in place.
"""

from __future__ import annotations

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
    "LAYER_MODULE",
    "install_attention_layer",
    "installed_attention_layer",
]

CPU_MODULE = "vllm.models.deepseek_v4.cpu.model"
CPU_SYMBOL = "DeepseekV4CPUAttention"
CUDA_MODULE = "vllm.models.deepseek_v4.nvidia.model"
CUDA_SYMBOL = "DeepseekV4FlashMLAAttention"
# The selector that reads CUDA_SYMBOL at call time, and the class that calls it.
CUDA_SELECTOR = "_select_dsv4_attn_cls"
CUDA_DECODER_LAYER = "DeepseekV4DecoderLayer"
# The vLLM minor versions the CUDA hook point was read from (the selector is
# byte-identical in 0.33.0 and 0.34.0).
CUDA_VLLM: tuple[tuple[int, int], ...] = ((0, 33), (0, 34))
LAYER_MODULE = "vllm_dsv4_backend.layer"

_installed: dict[str, Any] = {}


def installed_attention_layer() -> type | None:
    """The layer class installed in this process so far (None: vLLM's own)."""
    return _installed.get("cls")


def _check_layer_cls(cls: Any) -> type:
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention

    if not (isinstance(cls, type) and issubclass(cls, DeepseekV4Attention)):
        raise hooks.fail(
            "attention layer",
            f"{cls!r} is not a subclass of vllm.models.deepseek_v4.attention.DeepseekV4Attention",
        )
    return cls


def check_cuda_hook_points(module: ModuleType) -> type:
    """Check vLLM 0.33's / 0.34's CUDA hook point in ``module`` (``nvidia/model.py``) and
    return the class the module global holds now.

    The module global ``DeepseekV4FlashMLAAttention`` must be a
    ``DeepseekV4Attention`` subclass that ``_select_dsv4_attn_cls(vllm_config)``
    reads by name at call time, and ``DeepseekV4DecoderLayer.__init__`` must
    call that selector (the main model, MTP and DSpark all build through it).

    Raises:
        PatchError: another vLLM minor version, or a hook point that differs.
    """
    import vllm

    from vllm_dsv4_backend.vllm_compat import version

    got = version.parse_version(str(vllm.__version__))
    if got not in CUDA_VLLM:
        raise hooks.fail(
            f"{CUDA_MODULE}.{CUDA_SYMBOL}",
            "the plugin's CUDA layer was written against vLLM "
            + " and ".join(f"{a}.{b}.x" for a, b in CUDA_VLLM),
        )
    _, _, current = hooks.resolve(module, CUDA_SYMBOL)
    if not isinstance(current, type):
        raise hooks.fail(f"{CUDA_MODULE}.{CUDA_SYMBOL}", f"is {current!r}, not a class")
    _check_layer_cls(current)
    _, _, selector = hooks.resolve(module, CUDA_SELECTOR)
    hooks.check_signature(f"{CUDA_MODULE}.{CUDA_SELECTOR}", selector, ("vllm_config",))
    names = getattr(getattr(selector, "__code__", None), "co_names", ())
    if CUDA_SYMBOL not in names:
        raise hooks.fail(
            f"{CUDA_MODULE}.{CUDA_SELECTOR}",
            f"no longer reads the module global {CUDA_SYMBOL}",
        )
    _, _, decoder = hooks.resolve(module, CUDA_DECODER_LAYER)
    init_names = getattr(getattr(decoder.__init__, "__code__", None), "co_names", ())
    if CUDA_SELECTOR not in init_names:
        raise hooks.fail(
            f"{CUDA_MODULE}.{CUDA_DECODER_LAYER}.__init__",
            f"no longer builds its attention layer through {CUDA_SELECTOR}",
        )
    return current


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
            ``"cuda"`` (rebinds ``nvidia.model.DeepseekV4FlashMLAAttention``).
        on_applied: called with a description once the swap is in place.
        optional: if resolving ``cls`` raises ``NotImplementedError`` (the
            provider has no layer for this platform), keep vLLM's layer and
            log a warning instead of failing (``VLLM_DSV4_ATTN_IMPL=auto``).

    Raises:
        ValueError: unknown ``platform``.
        PatchError: (when the model module is imported, unless ``optional``)
            the hook point is missing, ``cls`` is not a ``DeepseekV4Attention``
            subclass, or resolving it raised anything else (the cause chained);
            with ``optional`` each of these is one ERROR line naming the patch
            ``attention_layer``, and vLLM's own layer stays.
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

    def place_cpu(module: ModuleType, layer: type | None) -> None:
        # layer None: only check the hook point. Rebinds the module global.
        owner, attr, current = hooks.resolve(module, CPU_SYMBOL)
        if not isinstance(current, type):
            raise hooks.fail(f"{CPU_MODULE}.{CPU_SYMBOL}", f"is {current!r}, not a class")
        if layer is not None and current is not layer:
            hooks.set_attr(owner, attr, layer)

    def place_cuda(module: ModuleType, layer: type | None) -> None:
        current = check_cuda_hook_points(module)
        if layer is None or current is layer:
            return
        if not issubclass(layer, current):
            raise hooks.fail(
                f"{CUDA_MODULE}.{CUDA_SYMBOL}",
                f"is {current.__module__}.{current.__qualname__}, which "
                f"{layer.__qualname__} does not subclass",
            )
        hooks.set_attr(module, CUDA_SYMBOL, layer)

    target, place = (
        (f"{CPU_MODULE}.{CPU_SYMBOL}", place_cpu) if platform == "cpu"
        else (f"{CUDA_MODULE}.{CUDA_SYMBOL}", place_cuda)
    )

    def install(module: ModuleType) -> None:
        # Fail closed: a hook point or copied body that differs from the vLLM the
        # plugin was read from (a patch release), or anything else the layer's
        # resolution raises, keeps vLLM's own layer with one ERROR line, or
        # raises under VLLM_DSV4_ATTN_IMPL=plugin (not optional).
        record: hooks.Record = []
        try:
            with hooks.recording(record):
                place(module, None)
                resolved = resolve()
                if resolved is None:
                    return
                layer = _check_layer_cls(resolved)
                place(module, layer)
                _register_backend_of(layer)
        except Exception as e:  # noqa: BLE001 - whatever the layer raises, vLLM keeps serving
            hooks.undo(record)
            err = hooks.patch_failed(
                "attention_layer", module.__name__, e, strict=not optional,
                kept=f"keeping vLLM's own DeepSeek-V4 attention layer on {platform.upper()}")
            if on_applied:
                on_applied(f"attention:vllm (plugin layer not installed: {err})")
            if not optional:
                raise err from e
            return
        _installed["cls"] = layer
        if on_applied:
            on_applied(f"attention:{target}={layer.__qualname__}")

    hooks.when_imported(CPU_MODULE if platform == "cpu" else CUDA_MODULE, install)
