# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``vllm.general_plugins`` entry point: ``vllm_dsv4_backend.plugin:register``.

vLLM calls :func:`register` once in every process it starts (API server /
``LLM`` process, engine core, each worker), for every model. It is idempotent
(module flag), cheap (no DeepSeek-V4 module is imported here: patches are
armed and applied when vLLM itself imports their targets, see
:mod:`vllm_dsv4_backend.vllm_compat`) and it never makes vLLM fail for a
combination it does not support: an unknown vLLM version, a platform
without a plugin layer, or a hook point that changed (a patch release) is
logged as one ERROR line naming the installed vLLM, the supported versions
and what the plugin did (installed nothing, or only the platform-neutral
config hooks; vLLM's own DeepSeek-V4 layer kept), and vLLM serves every
model as if the plugin were absent. Only an explicit request fails:
``VLLM_DSV4_ATTN_IMPL=plugin`` on an unsupported combination raises
``RuntimeError`` with the same message at startup.
``VLLM_DSV4_SKIP_VERSION_CHECK=1`` loads it on an unknown vLLM version anyway.

Per process it logs one line through vLLM's handlers::

    vllm_dsv4_backend 0.1.0: registered FLASHMLA_SPARSE_DSV4 (vLLM 0.32.0, cpu, \
role worker; attention layer: vllm DeepseekV4CPUAttention; patches armed: ...)

With ``VLLM_DSV4_MARKER_DIR`` set it also writes ``<dir>/<role>-<pid>.json``
(updated as patches apply), which the tests use to prove the plugin ran
inside the engine-core and worker processes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading
from typing import Any

from vllm_dsv4_backend import __version__, envs
from vllm_dsv4_backend._logging import attach_to_vllm, init_logger

__all__ = ["process_role", "register", "state"]

logger = init_logger(__name__)

_REGISTERED = False
_lock = threading.RLock()
_state: dict[str, Any] = {"applied": []}


def process_role() -> str:
    """vLLM role of this process from its multiprocessing name.

    ``frontend`` (API server or ``LLM`` caller), ``engine_core``
    (``EngineCore[_DPn]``), ``worker`` (``VllmWorker-n``), ``model_inspect``
    (the ``python -m vllm.model_executor.models.registry`` subprocess vLLM
    runs to inspect a model class), else the raw name.
    """
    name = multiprocessing.current_process().name
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0.replace(os.sep, "/").endswith("model_executor/models/registry.py"):
        return "model_inspect"
    if name == "MainProcess" or name.startswith("ApiServer"):
        return "frontend"
    if name.startswith("EngineCore"):
        return "engine_core"
    if name.startswith("VllmWorker") or name.startswith("Worker"):
        return "worker"
    return name.replace("/", "_")


def state() -> dict[str, Any]:
    """A copy of what register() did in this process (for tests and logs)."""
    with _lock:
        return json.loads(json.dumps(_state))


def _write_marker() -> None:
    marker_dir = envs.VLLM_DSV4_MARKER_DIR
    if marker_dir is None:
        return
    with _lock:
        payload = json.dumps(_state, indent=2, sort_keys=True)
        os.makedirs(marker_dir, exist_ok=True)
        path = os.path.join(marker_dir, f"{_state['role']}-{_state['pid']}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(payload)
        os.replace(tmp, path)


def _on_applied(desc: str) -> None:
    with _lock:
        _state["applied"].append(desc)
    logger.debug("applied %s", desc)
    _write_marker()


def _platform_name() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return str(getattr(current_platform, "device_name", None) or current_platform._enum.name)


def _select_attention_layer(platform: str) -> str:
    """Install the plugin's layer per ``VLLM_DSV4_ATTN_IMPL``; describe the choice."""
    from vllm_dsv4_backend.vllm_compat import attention

    impl = envs.VLLM_DSV4_ATTN_IMPL
    vllm_layer = {"cpu": "DeepseekV4CPUAttention", "cuda": "DeepseekV4FlashMLAAttention"}.get(
        platform, "default"
    )
    if impl == "vllm":
        return f"vllm {vllm_layer} (VLLM_DSV4_ATTN_IMPL=vllm)"
    # The layer package is imported directly (it is cheap: each platform's module is
    # imported only when the model module is, through the factory below).
    from vllm_dsv4_backend import layer as plugin_layer

    if platform not in plugin_layer.PLATFORMS:
        if impl == "plugin":
            raise RuntimeError(
                "VLLM_DSV4_ATTN_IMPL=plugin but the plugin ships no DeepSeek-V4 attention "
                f"layer for platform {platform!r} (supported: {sorted(plugin_layer.PLATFORMS)}); "
                "use VLLM_DSV4_ATTN_IMPL=vllm"
            )
        return f"vllm {vllm_layer} (no plugin layer for {platform})"
    attention.install_attention_layer(
        lambda: plugin_layer.get_attention_layer_cls(platform), platform=platform,
        on_applied=_on_applied, optional=impl == "auto",
    )
    return f"plugin {attention.LAYER_MODULE} (VLLM_DSV4_ATTN_IMPL={impl})"


def _stand_aside(problem: str, vllm_version: str, platform: str) -> tuple[list[str], str]:
    """Log why the plugin stands aside in this process; arm only what is safe.

    On a vLLM minor the plugin knows (a platform without a plugin layer) the
    platform-neutral config hooks stay armed (``use_fp4_indexer_cache``, the
    architecture check); on an unknown vLLM nothing is installed.
    """
    from vllm_dsv4_backend.vllm_compat import patches, version

    supported = version.supported_versions_text()
    if envs.VLLM_DSV4_ATTN_IMPL == "plugin":
        raise RuntimeError(
            f"{problem}; supported: {supported}. VLLM_DSV4_ATTN_IMPL=plugin asks for the "
            "plugin's layer: unset it (or set VLLM_DSV4_ATTN_IMPL=vllm) to serve with vLLM's "
            "own DeepSeek-V4 layer"
        )
    if version.is_known_version(vllm_version):
        envs.register_with_vllm()
        armed = patches.arm(platform, _on_applied, strict=False, neutral_only=True)
        did = (f"kept vLLM's own DeepSeek-V4 layer; installed only the config hooks "
               f"({', '.join(armed)})")
    else:
        armed = []
        did = "installed nothing; vLLM's own DeepSeek-V4 layer and config handling are kept"
    logger.error(
        "%s; supported: %s. vllm_dsv4_backend %s %s, and vLLM serves every model as if the "
        "plugin were absent (VLLM_DSV4_ATTN_IMPL=plugin makes this an error)",
        problem, supported, __version__, did,
    )
    return armed, f"vllm (plugin stood aside: {problem})"


def _setup_metrics() -> str | None:
    """The front end's /metrics collector for the workspace figures
    (:mod:`vllm_dsv4_backend.metrics`); an error is one WARNING, never a failure."""
    try:
        from vllm_dsv4_backend import metrics

        return metrics.setup_frontend()
    except Exception as e:  # noqa: BLE001 - observability must never stop vLLM
        logger.warning("vllm_dsv4_backend: no workspace figures on /metrics (%s: %s)",
                       type(e).__name__, e)
        return None


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent).

    Never raises for an unsupported combination unless
    ``VLLM_DSV4_ATTN_IMPL=plugin`` (see the module docstring), and never for
    an unexpected error of its own: that is one ERROR line, the hooks not yet
    run are dropped and vLLM goes on without the plugin (under ``plugin`` it
    raises).
    """
    global _REGISTERED
    try:
        _register()
    except Exception as e:
        # Asked for explicitly (or a bad value of the plugin's own setting, whose
        # reader raises here): a startup error, not a silent fallback.
        if envs.VLLM_DSV4_ATTN_IMPL == "plugin":
            raise
        from vllm_dsv4_backend.vllm_compat import hooks

        dropped = hooks.disarm_all()
        with _lock:
            _REGISTERED = True
            _state.update(armed=[], stood_aside=f"register() failed: {type(e).__name__}: {e}")
        logger.error(
            "vllm_dsv4_backend %s: register() failed (%s: %s); the plugin stands aside "
            "(hooks dropped for: %s) and vLLM serves with its own code",
            __version__, type(e).__name__, e, ", ".join(dropped) or "none",
        )


def _register() -> None:
    global _REGISTERED
    with _lock:
        if _REGISTERED:
            return
        attach_to_vllm()
        import vllm

        from vllm_dsv4_backend.vllm_compat import patches, version

        vllm_version = str(getattr(vllm, "__version__", "unknown"))
        try:
            platform = _platform_name()
        except Exception as e:  # noqa: BLE001 - a vLLM whose platform API moved
            platform = f"unknown ({type(e).__name__}: {e})"
        _state.update(
            role=process_role(),
            pid=os.getpid(),
            ppid=os.getppid(),
            process_name=multiprocessing.current_process().name,
            plugin_version=__version__,
            # Where this process imported the plugin from (an installed wheel or a checkout).
            package_dir=os.path.dirname(os.path.abspath(__file__)),
            vllm_version=vllm_version,
            platform=platform,
        )
        problem = version.support_problem(vllm_version, platform)
        if problem is not None:
            armed, layer = _stand_aside(problem, vllm_version, platform)
            _state.update(armed=armed, attention_layer=layer, stood_aside=problem)
            _REGISTERED = True
            _write_marker()
            return
        envs.register_with_vllm()
        # Every patch of vLLM is an entry of the registry (vllm_compat.patches).
        # A hook point that differs (a patch release) is an ERROR log and vLLM's
        # code kept, unless the plugin was asked for explicitly.
        strict = envs.VLLM_DSV4_ATTN_IMPL == "plugin"
        armed = patches.arm(platform, _on_applied, strict=strict)
        layer = _select_attention_layer(platform)
        _state.update(armed=armed, attention_layer=layer)
        if _state["role"] == "frontend":
            _state["metrics_dir"] = _setup_metrics()
        _REGISTERED = True
    logger.info(
        "vllm_dsv4_backend %s: registered FLASHMLA_SPARSE_DSV4 (vLLM %s, %s, role %s; "
        "attention layer: %s; patches armed: %s)",
        __version__,
        vllm_version,
        platform,
        _state["role"],
        layer,
        ", ".join(armed),
    )
    _write_marker()
