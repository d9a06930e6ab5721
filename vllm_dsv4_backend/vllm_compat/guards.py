# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Startup checks: FLASHMLA_SPARSE_DSV4 is for DeepSeek-V4 only.

vLLM's CPU platform ignores ``--attention-backend`` for ordinary models (it
logs "Cannot use ... backend on CPU" and serves with CPU_ATTN), and a CUDA
build would try to build a generic layer on a DeepSeek-V4-only backend. A
user who asked for this backend on another architecture gets a clear
startup error instead, before anything is served. The hook is the
``architecture_check`` entry of :mod:`.patches`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dsv4_backend.vllm_compat import hooks

BACKEND_NAME = "FLASHMLA_SPARSE_DSV4"
SUPPORTED_ARCHITECTURES = ("DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration")
"""Architectures the backend serves. ``DeepseekV4ForConditionalGeneration``
(the vision variant; vLLM's architecture convertor also routes a
``DeepseekV4ForCausalLM`` config with ``vision_n_layers > 0`` to it) builds
its language model with ``init_vllm_registered_model(...,
architectures=["DeepseekV4ForCausalLM"])``, so its attention layers are the
same DeepSeek-V4 layers the plugin replaces; its hf_config is the text
model's, flat, so :func:`check_settings` reads the same fields."""
V41_ARCHITECTURES = ("DeepseekV41ForCausalLM",)
"""DeepSeek-V4.1: vLLM (0.32 to 0.34) maps ``FLASHMLA_SPARSE_DSV4`` on it to V4.1's own
attention class (``vllm.models.deepseek_v41.nvidia.model._select_dsv4_attn_cls`` returns
``vllm.models.deepseek_v41.nvidia.flashmla.DeepseekV4FlashMLAAttention``, a V4.1 layer with
its ``candidate_block_buffer``), which the plugin does not replace: the plugin stands aside
with one log line (:func:`check_architecture`); under ``VLLM_DSV4_ATTN_IMPL=plugin`` that
is a startup error."""
_v41_logged: list[str] = []


def check_architecture(vllm_config: Any) -> None:
    """Raise ``ValueError`` if FLASHMLA_SPARSE_DSV4 is requested for a model
    that is not DeepSeek-V4."""
    backend = vllm_config.attention_config.backend
    if backend is None or getattr(backend, "name", str(backend)) != BACKEND_NAME:
        return
    model_config = vllm_config.model_config
    archs = list(getattr(model_config, "architectures", None) or [])
    if any(a in SUPPORTED_ARCHITECTURES for a in archs):
        return
    v41 = [a for a in archs if a in V41_ARCHITECTURES]
    if v41:
        _stand_aside_for_v41(v41[0], model_config)
        return
    raise ValueError(
        f"--attention-backend {BACKEND_NAME} (vllm_dsv4_backend) serves only DeepSeek-V4 "
        f"(architectures {list(SUPPORTED_ARCHITECTURES)}); model {model_config.model!r} has "
        f"architectures {archs}. Drop --attention-backend to let vLLM choose a backend for "
        "this model."
    )


RAY_DOC = "docs/parallel.md#ray-multi-node"
_ray_warned: list[str] = []


def uses_ray(parallel_config: Any) -> bool:
    """Whether vLLM will run the Ray executor (``--distributed-executor-backend ray``)."""
    backend = getattr(parallel_config, "distributed_executor_backend", None)
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", "")
    return name == "ray" or name.startswith("Ray")


def ray_problem(platform: Any) -> str | None:
    """Why vLLM's ``platform`` cannot run the Ray executor (``None``: it can): vLLM's
    ``initialize_ray_cluster`` asks the platform for its Ray device key (``GPU`` on CUDA,
    ROCm, XPU) to build the placement group's bundles and raises ``ValueError: current
    platform <name> does not support ray.`` when it is empty, after ``ray.init`` has
    started or joined a cluster; vLLM 0.32's CPU platform declares none."""
    if getattr(platform, "ray_device_key", ""):
        return None
    name = getattr(platform, "device_name", "?")
    return (f"vLLM's {name} platform cannot run the Ray executor (--distributed-executor-"
            f"backend ray): it declares no Ray device key (Platform.ray_device_key is empty), "
            f"so vLLM's initialize_ray_cluster stops the engine with 'current platform {name} "
            "does not support ray.' after starting a Ray cluster. Serve with the "
            "multiprocessing executor (the default; PP, TP x PP and DP on one machine, "
            f"{RAY_DOC})")


def check_executor(vllm_config: Any) -> None:
    """Say at startup, before Ray starts, that this platform cannot run the Ray executor:
    a ``ValueError`` for DeepSeek-V4 on ``FLASHMLA_SPARSE_DSV4``, one WARNING for other
    models (vLLM's own error follows; the plugin changes nothing for them)."""
    if not uses_ray(vllm_config.parallel_config):
        return
    from vllm.platforms import current_platform

    problem = ray_problem(current_platform)
    if problem is None:
        return
    backend = vllm_config.attention_config.backend
    archs = list(getattr(vllm_config.model_config, "architectures", None) or [])
    if (backend is not None and getattr(backend, "name", str(backend)) == BACKEND_NAME
            and any(a in SUPPORTED_ARCHITECTURES for a in archs)):
        raise ValueError(f"{problem} (vllm_dsv4_backend)")
    if problem not in _ray_warned:
        _ray_warned.append(problem)
        from vllm_dsv4_backend._logging import init_logger

        init_logger(__name__).warning("vllm_dsv4_backend: %s", problem)


def _stand_aside_for_v41(arch: str, model_config: Any) -> None:
    """DeepSeek-V4.1 on ``FLASHMLA_SPARSE_DSV4``: vLLM's own V4.1 path, said once per
    process (an error under ``VLLM_DSV4_ATTN_IMPL=plugin``)."""
    from vllm_dsv4_backend import envs
    from vllm_dsv4_backend._logging import init_logger

    why = (f"{arch} (model {getattr(model_config, 'model', '?')!r}) is DeepSeek-V4.1: vLLM "
           f"maps --attention-backend {BACKEND_NAME} on it to V4.1's own attention layer "
           "(vllm.models.deepseek_v41), which keeps its cross-layer buffers "
           "(topk_indices_buffer, candidate_block_buffer); the plugin's layer and workspace "
           "serve DeepSeek-V4 only")
    if envs.VLLM_DSV4_ATTN_IMPL == "plugin":
        raise ValueError(f"{why}. VLLM_DSV4_ATTN_IMPL=plugin asks for the plugin's layer: "
                         "unset it to serve DeepSeek-V4.1 with vLLM's own layer")
    if arch not in _v41_logged:
        _v41_logged.append(arch)
        init_logger(__name__).warning("vllm_dsv4_backend stands aside: %s; vLLM's own "
                                      "DeepSeek-V4.1 layer serves", why)


def _block_of(hf_config: Any) -> int:
    """The weights' quantization block along the output dim (1 when unquantized)."""
    quant = getattr(hf_config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = getattr(quant, "__dict__", {})
    block = quant.get("weight_block_size") or [1]
    return int(block[0])


def tp_shape_problems(hf_config: Any, tp: int, expert_parallel: bool = False) -> list[str]:
    """Per-rank shapes DeepSeek-V4 cannot take at tensor-parallel size ``tp``.

    Each rank holds ``heads / tp`` attention heads, ``o_groups / tp`` output
    groups (``wo_a`` is a grouped projection), ``moe_intermediate_size x
    n_shared_experts / tp`` columns of the fp8 shared expert, a whole number
    of the checkpoint's fp8 weight blocks (vllm#40955: DeepSeek-V4-Pro at TP
    16 gives 3072 / 16 = 192, not a multiple of 128), and, without expert
    parallelism, ``moe_intermediate_size / tp`` columns of every routed expert.
    Returns one line per violated dimension, then the TP sizes that work;
    empty when ``tp`` is fine.
    """
    block = _block_of(hf_config)
    dims: list[tuple[str, int, int]] = [
        ("num_attention_heads", int(hf_config.num_attention_heads), 1),
        ("o_groups", int(getattr(hf_config, "o_groups", 1) or 1), 1),
    ]
    inter = getattr(hf_config, "moe_intermediate_size", None)
    if inter:
        shared = int(getattr(hf_config, "n_shared_experts", 0) or 0)
        if shared:
            dims.append(("moe_intermediate_size x n_shared_experts", int(inter) * shared, block))
        if not expert_parallel:
            # Routed experts use their own (FP4) blocks: only divisibility is checked.
            dims.append(("moe_intermediate_size", int(inter), 1))

    def fits(size: int, unit: int, t: int) -> bool:
        return size % t == 0 and (size // t) % unit == 0

    works = [t for t in (1, 2, 4, 8, 16, 32, 64) if all(fits(n, u, t) for _, n, u in dims)]
    problems = []
    for name, size, unit in dims:
        if not fits(size, unit, tp):
            per_rank = f"{size} / {tp} = {size / tp:g}"
            need = "a whole number" if unit == 1 else f"a multiple of the {unit}-wide fp8 block"
            problems.append(f"{name} {per_rank} per rank is not {need}")
    if problems:
        problems.append(f"tensor-parallel sizes that work for this model: {works}"
                        + ("" if expert_parallel else
                           " (--enable-expert-parallel lifts the routed-expert constraint)"))
    return problems


def check_settings(engine_args: Any, vllm_config: Any) -> None:
    """Refuse, for DeepSeek-V4 on FLASHMLA_SPARSE_DSV4, the flags the backend
    cannot honour instead of letting vLLM silently change them: a
    ``--kv-cache-dtype`` that is not the 584 B fp8_ds_mla format, and a
    ``--block-size`` other than the kernels' 256 tokens (vLLM's CPU platform
    overrides it with only a warning), and a ``--tensor-parallel-size`` whose
    per-rank shapes the layers cannot take (:func:`tp_shape_problems`)."""
    from vllm_dsv4_backend.formats.constants import KERNEL_BLOCK_SIZE, KV_CACHE_DTYPES

    backend = vllm_config.attention_config.backend
    if backend is None or getattr(backend, "name", str(backend)) != BACKEND_NAME:
        return
    archs = list(getattr(vllm_config.model_config, "architectures", None) or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        return
    kv_dtype = getattr(engine_args, "kv_cache_dtype", None)
    if kv_dtype is not None and str(kv_dtype) not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {kv_dtype}: {BACKEND_NAME} (vllm_dsv4_backend) stores DeepSeek-V4's "
            f"KV in the 584 B fp8_ds_mla format; supported: {list(KV_CACHE_DTYPES)} (all the "
            "same format)"
        )
    block = getattr(engine_args, "block_size", None)
    if block is not None and int(block) != KERNEL_BLOCK_SIZE:
        raise ValueError(
            f"--block-size {block}: {BACKEND_NAME} (vllm_dsv4_backend) pages DeepSeek-V4's "
            f"caches in blocks of {KERNEL_BLOCK_SIZE} tokens (64 per SWA block, 64 C4 / 2 C128 "
            f"entries per compressed block); drop --block-size or pass {KERNEL_BLOCK_SIZE}"
        )
    parallel = vllm_config.parallel_config
    tp = int(parallel.tensor_parallel_size)
    problems = tp_shape_problems(vllm_config.model_config.hf_config, tp,
                                 bool(getattr(parallel, "enable_expert_parallel", False)))
    if problems:
        raise ValueError(
            f"--tensor-parallel-size {tp}: DeepSeek-V4's per-rank shapes do not fit: "
            + "; ".join(problems)
        )


def install_hook(arg_utils: ModuleType, on_applied: Callable[[str], None]) -> bool:
    """Check the architecture when vLLM builds its engine config
    (``EngineArgs.create_engine_config``); False if already in place."""
    symbol = "EngineArgs.create_engine_config"
    _, _, create = hooks.resolve(arg_utils, symbol)
    if hooks.is_port(create):
        return False

    @functools.wraps(create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = create(self, *args, **kwargs)
        try:
            check_architecture(config)
            check_settings(self, config)
            check_executor(config)
        except ValueError:
            raise  # the refusals themselves
        except Exception as e:  # noqa: BLE001 - runs for every model: a moved vLLM field
            # must not stop vLLM from serving the others.
            from vllm_dsv4_backend import envs

            strict = envs.VLLM_DSV4_ATTN_IMPL == "plugin"
            err = hooks.patch_failed("architecture_check", symbol, e, strict=strict,
                                     kept="vLLM's engine config used unchecked")
            if strict:
                raise err from e
        return config

    hooks.replace_attr(arg_utils, symbol, create_engine_config,
                       expected_params=("usage_context", "headless"))
    on_applied(f"config:{BACKEND_NAME} architecture check")
    return True
