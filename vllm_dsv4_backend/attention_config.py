# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Accept ``use_fp4_indexer_cache``, the attention-config flag users know.

vLLM replaced ``AttentionConfig.use_fp4_indexer_cache: bool`` with
``indexer_kv_dtype`` ("auto" | "fp8" | "mxfp4" | ...); 0.32/0.33 reject the old
key at argument parsing (``Unexpected keyword argument``, exit 2), which
breaks every published DeepSeek-V4 serve command. We translate it before
vLLM validates: ``true`` -> ``indexer_kv_dtype="mxfp4"``, ``false`` -> ``"fp8"``,
and refuse a contradiction with an explicit ``indexer_kv_dtype``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Any

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


def install() -> list[str]:
    """Patch vLLM's two entry points for attention configs; idempotent.

    - CLI / ``--config`` YAML: ``--attention-config`` JSON goes through
      ``arg_utils._expand_json_human_readable_numbers`` right before pydantic
      validates it.
    - Python: ``AttentionConfig(**dict)`` (``LLM(attention_config={...})``).

    Returns the names of what was patched.
    """
    from vllm.config.attention import AttentionConfig
    from vllm.engine import arg_utils

    patched: list[str] = []
    expand = getattr(arg_utils, "_expand_json_human_readable_numbers", None)
    if expand is None:
        raise RuntimeError(
            "vllm_dsv4_backend: vllm.engine.arg_utils._expand_json_human_readable_numbers "
            "is missing in this vLLM; cannot accept --attention-config "
            f"'{{\"{LEGACY_KEY}\":true}}'. Use indexer_kv_dtype instead."
        )
    if not getattr(expand, "_dsv4_patched", False):

        @functools.wraps(expand)
        def expand_and_normalize(val: str) -> str:
            return _normalize_json(expand(val))

        expand_and_normalize._dsv4_patched = True  # type: ignore[attr-defined]
        arg_utils._expand_json_human_readable_numbers = expand_and_normalize
    patched.append("attention-config JSON")

    init = AttentionConfig.__init__
    if not getattr(init, "_dsv4_patched", False):

        @functools.wraps(init)
        def init_normalized(self, *args: Any, **kwargs: Any) -> None:
            if LEGACY_KEY in kwargs:
                kwargs = normalize_attention_config(kwargs)
            init(self, *args, **kwargs)

        init_normalized._dsv4_patched = True  # type: ignore[attr-defined]
        AttentionConfig.__init__ = init_normalized  # type: ignore[method-assign]
    patched.append("AttentionConfig(use_fp4_indexer_cache=...)")

    # LLM(attention_config={...}) filters the dict through is_init_field(),
    # which raises before AttentionConfig sees it. LLM() loads plugins only
    # after that, so this helps callers that loaded plugins themselves
    # (vllm.plugins.load_general_plugins()) after importing LLM.
    llm_module = sys.modules.get("vllm.entrypoints.llm")
    if llm_module is not None:
        _patch_llm(llm_module)
        patched.append("LLM(attention_config={...})")
    return patched


def _patch_llm(module: Any) -> None:
    llm_init = module.LLM.__init__
    if getattr(llm_init, "_dsv4_patched", False):
        return

    @functools.wraps(llm_init)
    def init_normalized(self: Any, *args: Any, **kwargs: Any) -> None:
        cfg = kwargs.get("attention_config")
        if isinstance(cfg, dict):
            kwargs["attention_config"] = normalize_attention_config(cfg)
        llm_init(self, *args, **kwargs)

    init_normalized._dsv4_patched = True  # type: ignore[attr-defined]
    module.LLM.__init__ = init_normalized
