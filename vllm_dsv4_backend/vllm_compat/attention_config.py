# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Accept ``use_fp4_indexer_cache``, the attention-config flag users know.

vLLM replaced ``AttentionConfig.use_fp4_indexer_cache: bool`` with
``indexer_kv_dtype`` ("auto" | "fp8" | "mxfp4" | ...); 0.32/0.33 reject the old
key at argument parsing (``Unexpected keyword argument``, exit 2), which
breaks every published DeepSeek-V4 serve command. We translate it before
vLLM validates: ``true`` -> ``indexer_kv_dtype="mxfp4"``, ``false`` -> ``"fp8"``,
and refuse a contradiction with an explicit ``indexer_kv_dtype``.

The three hooks (``attention_config_json``, ``attention_config_init``,
``llm_attention_config``) are entries of :mod:`.patches`.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dsv4_backend.vllm_compat import hooks

LEGACY_KEY = "use_fp4_indexer_cache"


def normalize_attention_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Return ``cfg`` with ``use_fp4_indexer_cache`` mapped to ``indexer_kv_dtype``.

    Raises:
        ValueError: the legacy flag is not a bool, or contradicts an explicit
            ``indexer_kv_dtype``.
    """
    if LEGACY_KEY not in cfg:
        return cfg
    out = dict(cfg)
    flag = out.pop(LEGACY_KEY)
    if isinstance(flag, str) and flag.lower() in ("true", "false", "1", "0"):
        flag = flag.lower() in ("true", "1")
    if not isinstance(flag, bool):
        raise ValueError(
            f"attention-config {LEGACY_KEY} must be true or false, got {flag!r}"
        )
    wanted = "mxfp4" if flag else "fp8"
    explicit = out.get("indexer_kv_dtype", "auto")
    if explicit not in (None, "auto", wanted):
        raise ValueError(
            f"Contradictory attention-config: {LEGACY_KEY}={str(flag).lower()} means "
            f"indexer_kv_dtype={wanted!r}, but indexer_kv_dtype={explicit!r} was also "
            f"given. Pass only one of them (supported indexer_kv_dtype values for "
            f"DeepSeek-V4: 'fp8', 'mxfp4')."
        )
    out["indexer_kv_dtype"] = wanted
    _log_mapping(flag, wanted)
    return out


@functools.cache
def _log_mapping(flag: bool, wanted: str) -> None:
    from vllm_dsv4_backend._logging import init_logger

    init_logger(__name__).info(
        "attention-config %s=%s mapped to indexer_kv_dtype=%r (vLLM >= 0.32 name)",
        LEGACY_KEY,
        str(flag).lower(),
        wanted,
    )


def _normalize_json(val: str) -> str:
    try:
        parsed = json.loads(val)
    except (TypeError, ValueError):
        return val  # not ours to judge: vLLM reports its own parse error
    if isinstance(parsed, dict) and LEGACY_KEY in parsed:
        try:
            return json.dumps(normalize_attention_config(parsed))
        except ValueError as e:
            # argparse shows the text of ArgumentTypeError only; a ValueError
            # would become a bare "invalid parse_dataclass value".
            raise argparse.ArgumentTypeError(str(e)) from e
    return val


def install_json_hook(arg_utils: ModuleType, on_applied: Callable[[str], None]) -> bool:
    """CLI / ``--config`` YAML: map the legacy key in ``--attention-config`` JSON,
    which goes through ``arg_utils._expand_json_human_readable_numbers`` right
    before pydantic validates it. False if already in place (``hooks.is_port``)."""
    symbol = "_expand_json_human_readable_numbers"
    if not hasattr(arg_utils, symbol):
        raise hooks.fail(
            f"{arg_utils.__name__}.{symbol}",
            f"missing, so --attention-config '{{\"{LEGACY_KEY}\":true}}' cannot be accepted "
            "(use indexer_kv_dtype instead)",
        )
    expand = getattr(arg_utils, symbol)

    @functools.wraps(expand)
    def expand_and_normalize(val: str) -> str:
        return _normalize_json(expand(val))

    if not hooks.replace_attr(arg_utils, symbol, expand_and_normalize, expected_params=("val",)):
        return False
    on_applied("config:attention-config JSON")
    return True


def install_init_hook(arg_utils: ModuleType, on_applied: Callable[[str], None]) -> bool:
    """Python: ``AttentionConfig(**dict)`` (``LLM(attention_config={...})`` ends
    here too). False if already in place."""
    from vllm.config import attention as attention_module

    symbol = "AttentionConfig.__init__"
    _, _, init = hooks.resolve(attention_module, symbol)
    if hooks.is_port(init):
        return False
    fields = getattr(attention_module.AttentionConfig, "__dataclass_fields__", {})
    if "indexer_kv_dtype" not in fields:
        raise hooks.fail(f"{attention_module.__name__}.AttentionConfig",
                         "has no indexer_kv_dtype field to map use_fp4_indexer_cache onto")
    hooks.check_accepts_keyword(f"{attention_module.__name__}.{symbol}", init,
                                "indexer_kv_dtype")

    @functools.wraps(init)
    def init_normalized(self, *args: Any, **kwargs: Any) -> None:
        if LEGACY_KEY in kwargs:
            kwargs = normalize_attention_config(kwargs)
        init(self, *args, **kwargs)

    hooks.replace_attr(attention_module, symbol, init_normalized)
    on_applied("config:AttentionConfig(use_fp4_indexer_cache=...)")
    return True


def install_llm_hook(arg_utils: ModuleType, on_applied: Callable[[str], None]) -> bool:
    """``LLM(attention_config={...})`` filters the dict through
    ``is_init_field()``, which raises before ``AttentionConfig`` sees it.
    ``LLM()`` loads plugins only after that, so this helps callers that loaded
    plugins themselves (``vllm.plugins.load_general_plugins()``) after
    importing ``LLM``: applied only if ``vllm.entrypoints.llm`` is already
    imported when ``arg_utils`` is. False if not applied."""
    module = sys.modules.get("vllm.entrypoints.llm")
    if module is None:
        return False
    symbol = "LLM.__init__"
    _, _, llm_init = hooks.resolve(module, symbol)
    if hooks.is_port(llm_init):
        return False
    hooks.check_accepts_keyword(f"{module.__name__}.{symbol}", llm_init, "attention_config")

    @functools.wraps(llm_init)
    def init_normalized(self: Any, *args: Any, **kwargs: Any) -> None:
        cfg = kwargs.get("attention_config")
        if isinstance(cfg, dict):
            kwargs["attention_config"] = normalize_attention_config(cfg)
        llm_init(self, *args, **kwargs)

    hooks.replace_attr(module, symbol, init_normalized)
    on_applied("config:LLM(attention_config={...})")
    return True


def mxfp4_arch_error(capability: int | None, device_name: str | None) -> str | None:
    """The startup error for ``indexer_kv_dtype="mxfp4"`` (what
    ``use_fp4_indexer_cache=true`` maps to) on a CUDA GPU outside the SM100
    family, or None where it is supported. ``capability`` is
    ``major * 10 + minor`` (90 = H100/H200, 100 = B200/GB200)."""
    if capability is not None and capability // 10 == 10:
        return None
    cc = "unknown" if capability is None else f"{capability // 10}.{capability % 10}"
    return (
        f"{LEGACY_KEY}=true / indexer_kv_dtype='mxfp4' (the MXFP4 indexer cache) needs an "
        f"SM100-family GPU (compute capability 10.x: B200, GB200, B300); this GPU is "
        f"{device_name or 'unknown'} (compute capability {cc}). Supported here: "
        f"indexer_kv_dtype 'fp8' or 'auto' (= fp8), i.e. drop {LEGACY_KEY} or set it to "
        "false."
    )
