# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fingerprints of the vLLM methods whose bodies the plugin's layers repeat
(with only the output buffers changed) or whose module globals they swap.

vLLM's DeepSeek-V4 files change weekly. A copied body that silently drifts
from vLLM's would make the plugin's layer compute something vLLM no longer
does, so :func:`check` compares the source of each listed symbol with the
fingerprint recorded for the vLLM version it was read from, and fails loudly
(vLLM version, symbol, both fingerprints) when it differs. Re-read the new
vLLM source, update the override, then the table (``python -m
vllm_dsv4_backend.vllm_compat.fingerprints SYMBOL...`` prints the values).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Iterable

from vllm_dsv4_backend.vllm_compat import hooks

__all__ = [
    "KNOWN",
    "check",
    "definition",
    "definition_text",
    "fingerprint",
    "fingerprint_text",
    "source_fingerprint",
    "source_params",
]

# vLLM minor version -> {"module:qualname": sha256[:16] of the normalized source}
KNOWN: dict[str, dict[str, str]] = {
    "0.32": {
        "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUAttention.forward":
            "bad87d88271dd6de",
        "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUAttention.forward_mqa":
            "896634ba1fb6875f",
        "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUAttention._sparse_indexer_and_attn":
            "000c0a04b27111ae",
        "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUAttention._o_proj":
            "0790aa1a21f7f064",
        "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUIndexer.forward":
            "00ccbabde569ae9a",
        "vllm.models.deepseek_v4.cpu.cpu_sparse:_fused_indexer_q_rope_quant_cpu":
            "b0e50b53066c094b",
        "vllm.models.deepseek_v4.cpu.cpu_compressor:DeepseekV4CPUCompressor.forward":
            "fdb4c92a793e7a23",
        "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUIndexer._fill_short_context_topk":
            "3360905bf28beb17",
        "vllm.models.deepseek_v4.cpu.cpu_utils:map_local_to_global_slots_cpu":
            "048fa28e5e24680a",
        "vllm.model_executor.layers.sparse_attn_indexer:SparseAttnIndexer.forward_cpu":
            "bf2fb77b5fa5bdf2",
    },
    # Read from the vllm==0.33.0 wheel (layer/cuda.py COPIED_VLLM_BODIES).
    "0.33": {
        "vllm.models.deepseek_v4.attention:DeepseekV4Attention.forward":
            "f6cb1b89b5a9524e",
        "vllm.models.deepseek_v4.attention:DeepseekV4Attention._alloc_attn_out":
            "849d7b8129de8176",
        "vllm.models.deepseek_v4.attention:DeepseekV4Attention._sparse_indexer_and_attn":
            "6cbd97b346291a0e",
        "vllm.models.deepseek_v4.attention:DeepseekV4Attention._prepare_and_attn":
            "286b9609633989d6",
        "vllm.models.deepseek_v4.attention:DeepseekV4Indexer._q_rope_quant":
            "fb2555cb2fb4264a",
        "vllm.models.deepseek_v4.attention:DeepseekV4Indexer.forward":
            "5107191d0d64dabc",
        "vllm.models.deepseek_v4.common.ops.fused_indexer_q:fused_indexer_q_rope_quant":
            "ba22a863327681be",
        "vllm.models.deepseek_v4.common.ops.cache_utils:compute_global_topk_indices_and_lens":
            "d1d3086ee9a8f9d2",
        "vllm.models.deepseek_v4.compressor:DeepseekCompressor._compress_norm_rope_store":
            "45873ded08c4b0e9",
        "vllm.models.deepseek_v4.nvidia.flashmla:DeepseekV4FlashMLAAttention._forward_decode":
            "6caed9c89e317811",
        "vllm.models.deepseek_v4.nvidia.flashmla:DeepseekV4FlashMLAAttention.forward_mqa":
            "6b62ae5fa919f811",
        # The control flow the workspace fences rely on (layer/cuda.py FENCE_CONTROL_FLOW).
        "vllm.utils.multi_stream_utils:execute_in_parallel": "2640fdf87dd37260",
        "vllm.utils.multi_stream_utils:maybe_execute_in_parallel": "73fdf282243c4653",
        "vllm.compilation.breakable_cudagraph:eager_break_during_capture": "2c704948c5b1c76d",
        "vllm.compilation.breakable_cudagraph:BreakableCUDAGraphCapture": "8269becd5503697e",
        "vllm.models.deepseek_v4.compressor:DeepseekCompressor.forward": "2d960f098ef54037",
        "vllm.models.deepseek_v4.attention:DeepseekV4Attention._run_parallel_input_projections":
            "c12534fd255ef740",
        "vllm.models.deepseek_v4.attention:DeepseekV4Attention._prepare_and_attn_eager":
            "9fef557e90c02951",
    },
}
# Read from the vllm==0.34.0 wheel: 0.33's values but for four bodies that
# changed by a line each (forward: `_prepare_and_attn_fn(` -> `_prepare_and_attn(`;
# Indexer.forward: `_fill_short_context_topk_indices` made public;
# fused_indexer_q_rope_quant: its CPU branch imports `vllm._cpu_ops`;
# _run_parallel_input_projections: the compressors' `torch.mm(out_dtype=f32)`
# became their `fused_wkv_wgate` module, same streams), and without MRV1's
# `_prepare_and_attn_eager` (removed in 0.34).
KNOWN["0.34"] = {
    **{k: v for k, v in KNOWN["0.33"].items() if not k.endswith("._prepare_and_attn_eager")},
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention.forward": "f3dd00fb7c177bbb",
    "vllm.models.deepseek_v4.attention:DeepseekV4Indexer.forward": "67606356967df910",
    "vllm.models.deepseek_v4.common.ops.fused_indexer_q:fused_indexer_q_rope_quant":
        "351c53c1351daaae",
    "vllm.models.deepseek_v4.attention:DeepseekV4Attention._run_parallel_input_projections":
        "5cbce5f307abc0fc",
}


def _resolve(symbol: str) -> object:
    module_name, _, qualname = symbol.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def fingerprint_text(src: str) -> str:
    """The normalisation every fingerprint uses: sha256 (16 hex) of the source's
    non-empty lines, stripped (blank lines and indentation do not count)."""
    lines = [ln.strip() for ln in src.splitlines() if ln.strip()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def fingerprint(symbol: str) -> str:
    """:func:`fingerprint_text` of ``symbol``'s source (``module:qualname``, imported)."""
    return fingerprint_text(inspect.getsource(_resolve(symbol)))


def definition(tree: ast.AST, qualname: str) -> ast.ClassDef | ast.FunctionDef | None:
    """The class or function ``qualname`` (dotted) in a parsed module; None if missing."""
    node: ast.AST = tree
    for part in qualname.split("."):
        found = None
        for child in getattr(node, "body", []):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef)) and child.name == part:
                found = child
        if found is None:
            return None
        node = found
    return node  # type: ignore[return-value]


def definition_text(text: str, node: ast.ClassDef | ast.FunctionDef) -> str:
    """``node``'s source lines in ``text``, decorators included (what
    ``inspect.getsource`` returns for it)."""
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    return "\n".join(text.splitlines()[first - 1 : node.end_lineno])


def _source_definition(module_name: str, qualname: str) -> tuple[str, ast.AST] | None:
    # From the module's file, without importing it (CuTe DSL modules import cutlass).
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        return None
    with open(spec.origin, encoding="utf-8") as f:
        text = f.read()
    node = definition(ast.parse(text), qualname)
    return None if node is None else (text, node)


def source_fingerprint(module_name: str, qualname: str) -> str | None:
    """:func:`fingerprint` of a definition read from source text (for modules
    that cannot be imported on CPU); None if it is missing."""
    found = _source_definition(module_name, qualname)
    if found is None:
        return None
    text, node = found
    return fingerprint_text(definition_text(text, node))  # type: ignore[arg-type]


def source_params(module_name: str, qualname: str) -> list[str] | None:
    """Parameter names (without ``self``) of ``qualname`` in ``module_name``'s
    source file, read with ``ast`` (the module is not imported); ``None`` if
    the file or the definition is missing."""
    found = _source_definition(module_name, qualname)
    if found is None or not isinstance(found[1], ast.FunctionDef):
        return None
    args = found[1].args
    names = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
    return [n for n in names if n != "self"]


def check(symbols: Iterable[str], minor: str) -> None:
    """Raise ``PatchError`` unless every symbol's source matches its fingerprint
    for vLLM ``minor`` (e.g. ``"0.32"``)."""
    table = KNOWN.get(minor)
    if table is None:
        raise hooks.fail("copied vLLM bodies", f"no fingerprints recorded for vLLM {minor}.x")
    for symbol in symbols:
        want = table.get(symbol)
        if want is None:
            raise hooks.fail(symbol, f"no fingerprint recorded for vLLM {minor}.x")
        try:
            got = fingerprint(symbol)
        except (AttributeError, ImportError, OSError, TypeError) as e:
            raise hooks.fail(symbol, f"cannot be read ({e})") from e
        if got != want:
            raise hooks.fail(
                symbol,
                f"its source changed (fingerprint {got}, the plugin's override was written "
                f"against {want}); the plugin's copy of this body must be re-read",
            )


if __name__ == "__main__":  # pragma: no cover
    for s in sys.argv[1:]:
        print(f'"{s}": "{fingerprint(s)}",')
