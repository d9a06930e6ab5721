# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Write a small stand-in ``vllm`` package whose DeepSeek-V4 control flow is
vLLM's own, cut verbatim (by AST) out of an installed vLLM or a wheel.

    python tools/cuda_graph/build_stub.py --vllm-src DIR|--wheel FILE --out build/vllm_stub/0.34

What is vLLM's, verbatim (each body's fingerprint is printed, next to the one
the plugin recorded, and written to ``FINGERPRINTS.txt``; the normalisation
is ``vllm_compat/fingerprints.py``'s: decorators included, stripped non-empty
lines, sha256[:16]):

* every symbol of the CUDA layer's drift table (``VLLM_DRIFT`` in
  ``vllm_dsv4_backend/layer/cuda.py``, read from its text: this tool does not
  import vLLM) in the modules listed in :data:`CUT`, in vLLM's source order
  (required where the table records a fingerprint for this vLLM minor,
  skipped where it records the symbol as absent). Today:
  ``DeepseekV4Attention``'s ``forward``, ``_alloc_attn_out``,
  ``_prepare_and_attn`` (+ ``_prepare_and_attn_eager`` in 0.33),
  ``_run_parallel_input_projections``, ``_sparse_indexer_and_attn``;
  ``DeepseekV4Indexer.forward`` / ``._q_rope_quant``;
  ``DeepseekCompressor.forward`` / ``._compress_norm_rope_store``;
  ``DeepseekV4FlashMLAAttention.forward_mqa`` / ``._forward_decode``;
  ``eager_break_during_capture`` and ``BreakableCUDAGraphCapture``;
* ``vllm/utils/multi_stream_utils.py`` whole (the table's
  ``execute_in_parallel`` / ``maybe_execute_in_parallel``);
* ``vllm/v1/worker/ubatching.py`` whole (``UBatchContext``,
  ``make_ubatch_contexts``, the ``dbo_*`` hand-overs).

A table symbol in a module the stub neither cuts, copies whole nor stands in
for (:data:`STANDIN`) stops the build: adding an entry to the table is all it
takes to have the stub cut it.

Everything else is a small shim written here (forward context, logger,
platform, envs, ``CUDAGraphMode``) or a stand-in for a CUDA-only kernel or a
module vLLM's bodies call (``tools/cuda_graph/standins.py``, copied in as
``vllm/_harness_standins.py``). Kernel substitutions are done by binding
the *names* the cut bodies call to stand-ins; the bodies' text is not edited.
The one non-kernel substitution: ``_weak_ref_capture_arg`` keeps a strong
reference (vLLM's ``weak_ref_tensor`` is a C++ op).
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The plugin's fingerprint normalisation and definition lookup (vLLM-free), so a
# cut body's printed fingerprint is the one the plugin's drift check computes.
sys.path.insert(0, str(HERE.parent.parent))
from vllm_dsv4_backend.vllm_compat.fingerprints import (  # noqa: E402
    definition,
    definition_text,
    fingerprint_text,
    read_table,
)

ATTN = "vllm/models/deepseek_v4/attention.py"
COMP = "vllm/models/deepseek_v4/compressor.py"
FLASHMLA = "vllm/models/deepseek_v4/nvidia/flashmla.py"
MSU = "vllm/utils/multi_stream_utils.py"
BCG = "vllm/compilation/breakable_cudagraph.py"
UBATCH = "vllm/v1/worker/ubatching.py"
# The kernel wrappers both layers reach, cut verbatim (the drift table's "copied"
# entries in them), and the sources of the kernel objects' signatures.
INDEXER_Q = "vllm/models/deepseek_v4/common/ops/fused_indexer_q.py"
CACHE_UTILS = "vllm/models/deepseek_v4/common/ops/cache_utils.py"
COMPRESS_CUTE = "vllm/models/deepseek_v4/nvidia/ops/sparse_attn_compress_cutedsl.py"
INDEXER_Q_CUTE = "vllm/models/deepseek_v4/nvidia/ops/fused_indexer_q_cutedsl.py"
FLASHMLA_IFACE = "vllm/third_party/flashmla/flash_mla_interface.py"
NEEDED = (ATTN, COMP, FLASHMLA, MSU, BCG, UBATCH, INDEXER_Q, CACHE_UTILS, COMPRESS_CUTE,
          INDEXER_Q_CUTE, FLASHMLA_IFACE, "vllm/version.py", "vllm/_version.py")
# The CUDA layer module whose drift table says which vLLM bodies to cut.
LAYER = HERE.parent.parent / "vllm_dsv4_backend" / "layer" / "cuda.py"


def _module(rel: str) -> str:
    return rel[:-3].replace("/", ".")


# How the stub provides each module the drift table names: its symbols cut
# verbatim (into the class sections of ``build``), the file copied whole, or
# stand-ins (kernels: ``COMMON_OPS`` / ``CUTEDSL`` below, the harness's doubles).
CUT: dict[str, str] = {_module(rel): rel for rel in (ATTN, COMP, FLASHMLA, BCG, INDEXER_Q,
                                                     CACHE_UTILS, COMPRESS_CUTE)}
WHOLE: dict[str, str] = {_module(MSU): MSU}
STANDIN: tuple[str, ...] = ()

# vLLM's kernel objects that the plugin's adapter (``VllmCudaKernels``) and vLLM's
# wrappers both call, by the module global both import: (stub module file, global,
# source file, qualname of the callable whose parameters are the contract, the
# stand-in in standins.py that computes it, the interface checks of recording.py).
KERNELS: tuple[tuple[str, str, str, str, str, str], ...] = (
    (CACHE_UTILS, "_COMPUTE_GLOBAL_TOPK_INDICES_AND_LENS_KERNEL", CACHE_UTILS,
     "ComputeGlobalTopkIndicesAndLensKernel.__call__", "global_topk_kernel",
     "R.unit_last_stride_check(NAME, 'global_topk_indices', 'topk_indices', 'block_table')"),
    (INDEXER_Q, "_FUSED_INDEXER_Q_ROPE_QUANT_TRITON_KERNEL", INDEXER_Q,
     "FusedIndexerQRopeQuantTritonKernel.__call__", "indexer_q_fp8_triton",
     "R.unit_last_stride_check(NAME, 'index_q', 'index_q_fp8', 'index_weights_out')"),
    (INDEXER_Q, "_FUSED_INDEXER_Q_ROPE_MXFP4_TRITON_KERNEL", INDEXER_Q,
     "FusedIndexerQRopeMxFp4TritonKernel.__call__", "indexer_q_mxfp4_triton",
     ("R.unit_last_stride_check(NAME, 'index_q', 'index_q_packed', 'index_q_scale', "
     "'index_weights_out')")),
    (INDEXER_Q_CUTE, "_INDEXER_Q_FP8_KERNEL", INDEXER_Q_CUTE, "IndexerQFp8Kernel.__call__",
     "indexer_q_fp8_cutedsl", "R.unit_last_stride_check(NAME, 'q', 'q_fp8', 'weights_out')"),
    (INDEXER_Q_CUTE, "_INDEXER_Q_MXFP4_KERNEL", INDEXER_Q_CUTE, "IndexerQMxFp4Kernel.__call__",
     "indexer_q_mxfp4",
     "R.unit_last_stride_check(NAME, 'q', 'q_packed', 'q_scale', 'weights_out')"),
    (COMPRESS_CUTE, "_SPARSE_ATTN_COMPRESS_NORM_ROPE_STORE_C4_KERNEL", COMPRESS_CUTE,
     "SparseAttnCompressNormRopeStoreC4Kernel.__call__", "c4_compress_store", ""),
    (COMPRESS_CUTE, "_SPARSE_ATTN_COMPRESS_NORM_ROPE_STORE_FULL_C4_KERNEL", COMPRESS_CUTE,
     "SparseAttnCompressNormRopeStoreFullC4Kernel.__call__", "store_full_kv", ""),
    (COMPRESS_CUTE, "_SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL", COMPRESS_CUTE,
     "SparseAttnCompressC128Block8Kernel.__call__", "c128_compress",
     "R.unit_last_stride_check(NAME, 'compressed_kv')"),
    (COMPRESS_CUTE, "_SPARSE_ATTN_NORM_ROPE_STORE_KERNEL", COMPRESS_CUTE,
     "SparseAttnNormRopeStoreKernel.__call__", "c128_store",
     "R.unit_last_stride_check(NAME, 'compressed_kv')"),
    (COMPRESS_CUTE, "_SPARSE_ATTN_NORM_ROPE_STORE_FULL_KERNEL", COMPRESS_CUTE,
     "SparseAttnNormRopeStoreFullKernel.__call__", "store_full_kv", ""),
    (FLASHMLA, "flash_mla_with_kvcache", FLASHMLA_IFACE, "flash_mla_with_kvcache",
     "flash_mla_with_kvcache", "R.flash_mla_out_check, R.sparse_indices_check"),
)


def signature_text(src: Source, qualname: str, name: str) -> str:
    """A function ``name`` with the parameters of vLLM's ``qualname`` (``self``
    dropped, annotations dropped, kinds and defaults kept) and no body."""
    node = src.node(qualname)
    if not isinstance(node, ast.FunctionDef):
        raise SystemExit(f"build_stub: kernel {qualname} not found in {src.rel}")
    args = node.args
    if args.args and args.args[0].arg == "self":
        args.args = args.args[1:]
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if a is not None:
            a.annotation = None
    node.name, node.decorator_list, node.returns = name, [], None
    node.body = [ast.Expr(ast.Constant(...))]
    return ast.unparse(ast.fix_missing_locations(node)) + "\n"


def class_constants(src: Source, qualname: str) -> dict[str, object]:
    """The constant class attributes of the kernel's class (``state_block_size``):
    callers read them off the object."""
    owner = qualname.rpartition(".")[0]
    node = src.node(owner) if owner else None
    out: dict[str, object] = {}
    for stmt in getattr(node, "body", []):
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)
                and isinstance(stmt.value, ast.Constant)):
            out[stmt.targets[0].id] = stmt.value.value
    return out


def kernel_globals(root: Path, stub_rel: str) -> tuple[str, str]:
    """The signatures module's text for every kernel, and the kernel objects of
    stub module ``stub_rel`` (text placed after its imports)."""
    sigs, objs = [], []
    for where, name, rel, qualname, compute, checks in KERNELS:
        src = Source(root, rel)
        sigs.append(signature_text(src, qualname, name))
        if where == stub_rel:
            chk = checks.replace("NAME", repr(name))
            attrs = "".join(f", {k}={v!r}" for k, v in class_constants(src, qualname).items())
            objs.append(f"{name} = R.Kernel({name!r}, SIG.{name}, S.{compute}"
                        + (f", checks=({chk},)" if chk else "") + attrs + ")\n")
    return "import torch\n\n\n" + "\n\n".join(sigs), "".join(objs)


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def drift_table() -> dict:
    """The CUDA layer's drift table (``layer/cuda.py`` ``VLLM_DRIFT``)."""
    return read_table(LAYER)


def table_cuts(version: str) -> dict[str, list[tuple[str, bool]]]:
    """Per cut file: the table's ``(qualname, required)`` for vLLM ``version``
    (required: the table records its fingerprint for this minor; a minor the
    table does not know makes every cut optional)."""
    table = drift_table()
    minor = _minor(version)
    known = any(minor in hashes for _, hashes in table.values())
    out: dict[str, list[tuple[str, bool]]] = {rel: [] for rel in CUT.values()}
    for symbol, (_, hashes) in table.items():
        module, _, qualname = symbol.partition(":")
        if module in CUT:
            out[CUT[module]].append((qualname, known and hashes.get(minor) is not None))
        elif module not in WHOLE and module not in STANDIN:
            raise SystemExit(
                f"build_stub: the CUDA layer's drift table names {symbol}, a module the stub "
                "neither cuts, copies whole nor stands in for: add it to CUT, WHOLE or STANDIN "
                "in tools/cuda_graph/build_stub.py")
    return out


class Source:
    def __init__(self, root: Path, rel: str) -> None:
        self.rel = rel
        self.text = (root / rel).read_text(encoding="utf-8")
        self.lines = self.text.splitlines()
        self.tree = ast.parse(self.text)

    def node(self, qualname: str) -> ast.AST | None:
        return definition(self.tree, qualname)

    def cut(self, qualname: str) -> str | None:
        node = definition(self.tree, qualname)
        return None if node is None else definition_text(self.text, node) + "\n"


class Cuts:
    """The verbatim bodies, with their fingerprints."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = {rel: Source(root, rel) for rel in CUT.values()}
        self.log: list[tuple[str, str, int, int]] = []
        self.substituted: list[str] = []

    def get(self, rel: str, qualname: str, required: bool = True) -> str:
        text = self._get(rel, qualname, required)
        for (where, old, new, why) in SUBSTITUTIONS:
            n = text.count(old) if where == qualname else 0
            if n:
                text = text.replace(old, new)
                self.substituted.append(f"{qualname}: {old!r} -> {new!r} x{n} ({why})")
        return text

    def _get(self, rel: str, qualname: str, required: bool = True) -> str:
        src = self.files[rel]
        text = src.cut(qualname)
        if text is None:
            if required:
                raise SystemExit(f"build_stub: {qualname} not found in {rel}")
            return ""
        node = src.node(qualname)
        assert isinstance(node, (ast.ClassDef, ast.FunctionDef))
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        module = rel[:-3].replace("/", ".")
        self.log.append((f"{module}:{qualname}", fingerprint_text(text), first,
                         node.end_lineno or first))
        return text


# The only edits to a cut body's text (after its fingerprint is taken), where
# present: a kernel call with no CPU implementation. (qualname, old, new, why)
SUBSTITUTIONS: tuple[tuple[str, str, str, str], ...] = (
    ("DeepseekV4Attention._run_parallel_input_projections", "return torch.mm(",
     "return S.mm_out_dtype(", "torch.mm(out_dtype=) has no CPU kernel (vLLM 0.33)"),
)


def _version(root: Path) -> str:
    for rel in ("vllm/_version.py", "vllm/version.py"):
        p = root / rel
        if p.exists():
            for line in p.read_text().splitlines():
                for key in ("__version__ = version = ", "__version__ = ", "version = "):
                    if line.startswith(key):
                        return line[len(key):].strip().strip("'\"")
    dist = list(root.glob("vllm-*.dist-info"))
    if dist:
        return dist[0].name[len("vllm-"):].split(".dist-info")[0]
    raise SystemExit(f"build_stub: cannot tell the vLLM version under {root}")


# --- shims -------------------------------------------------------------------------------

HEADER = '''# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# GENERATED by tools/cuda_graph/build_stub.py from vLLM {version}; do not edit or commit.
from __future__ import annotations
'''

INIT = '''"""Stand-in vllm {version} package for the CUDA-graph harness (not vLLM)."""
__version__ = "{version}"
HARNESS_STUB = True
'''

ENVS = '''import os

VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD = int(
    os.environ.get("VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD", "1024"))
VLLM_USE_BREAKABLE_CUDAGRAPH = True


def __getattr__(name):
    raise AttributeError(f"vllm stub envs: {name} is not part of the harness stub")
'''

LOGGER = '''import logging


def init_logger(name):
    return logging.getLogger(name)
'''

CONFIG = '''import enum


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)


class VllmConfig:  # annotation only
    pass


class CompilationConfig:  # annotation only
    pass
'''

FORWARD_CONTEXT = '''import contextlib
import dataclasses
from typing import Any

from vllm.config import CUDAGraphMode


@dataclasses.dataclass
class BatchDescriptor:
    num_tokens: int = 0


@dataclasses.dataclass
class ForwardContext:
    attn_metadata: Any = None
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: Any = None


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, "no forward context is set"
    return _forward_context


def is_forward_context_available() -> bool:
    return _forward_context is not None


@contextlib.contextmanager
def override_forward_context(ctx):
    global _forward_context
    prev, _forward_context = _forward_context, ctx
    try:
        yield
    finally:
        _forward_context = prev


def set_forward_context(attn_metadata, mode=CUDAGraphMode.NONE, batch_descriptor=None):
    return override_forward_context(ForwardContext(attn_metadata, mode, batch_descriptor))
'''

PLATFORMS = '''import torch


class _CudaPlatform:
    """The harness stands for vLLM's CUDA build on any device."""

    device_type = "cuda"

    def is_cuda(self):
        return True

    def is_rocm(self):
        return False

    def is_xpu(self):
        return False

    def is_cpu(self):
        return False

    def fp8_dtype(self):
        return torch.float8_e4m3fn

    def get_device_capability(self):
        return None

    def get_device_name(self):
        return "harness"


current_platform = _CudaPlatform()
'''

IMPORT_UTILS = '''import os


def has_cutedsl() -> bool:
    # The harness runs the Triton dispatch unless HARNESS_CUTEDSL=1 (both call
    # recording stand-ins of vLLM's kernel objects).
    return os.environ.get("HARNESS_CUTEDSL") == "1"
'''

MATH_UTILS = '''def round_up(x: int, y: int) -> int:
    return ((x + y - 1) // y) * y
'''

BCG_HEAD = '''"""vLLM's eager_break_during_capture and BreakableCUDAGraphCapture, verbatim;
the rest is a shim."""
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context, is_forward_context_available

F = TypeVar("F", bound=Callable[..., Any])


def _weak_ref_capture_arg(arg: Any) -> Any:
    # Substitution: vLLM weak-refs tensor arguments with a C++ op
    # (weak_ref_tensor); the harness keeps them (the buffers live anyway).
    return arg


'''

TORCH_UTILS = '''import torch


def current_stream():
    return torch.cuda.current_stream()
'''

ATTN_HEAD = '''"""vLLM's DeepseekV4Attention / DeepseekV4Indexer control flow, verbatim;
the GEMMs, norms and the fused q-norm/RoPE/KV-insert are stand-ins."""
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

import vllm.envs as envs
from vllm import _harness_standins as S
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.forward_context import get_forward_context
from vllm.models.deepseek_v4.common.ops import fused_indexer_q_rope_quant
from vllm.models.deepseek_v4.compressor import DeepseekCompressor
from vllm.platforms import current_platform
from vllm.utils.multi_stream_utils import execute_in_parallel, maybe_execute_in_parallel

QuantizedActivation = torch.Tensor  # annotation only
AttentionMetadata = Any
fill_short_context_topk_indices = S.FillShortContext()
_fill_short_context_topk_indices = fill_short_context_topk_indices


class triton:  # noqa: N801 - the name the cut bodies use
    @staticmethod
    def next_power_of_2(n: int) -> int:
        return 1 << (int(n) - 1).bit_length()


class DeepseekV4Attention(nn.Module):
    PREFILL_CHUNK_SIZE: ClassVar[int] = 4

    # --- stand-ins (not vLLM's bodies) ------------------------------------------------

    def _fused_wqa_wkv_gemm(self, hidden_states):
        return S.matmul(hidden_states, self.w_qa_kv, hidden_states.dtype)

    def _split_qkv_and_norm(self, qr_kv):
        qr, kv = qr_kv.split([self.q_lora_rank, self.head_dim], dim=-1)
        qr = S.output(qr.shape, qr.dtype, qr.device,
                      lambda: S.rms_norm(qr, self.q_norm_weight, self.eps))
        kv = S.output(kv.shape, kv.dtype, kv.device,
                      lambda: S.rms_norm(kv, self.kv_norm_weight, self.eps))
        return qr, None, kv

    def _wq_b_proj(self, qr, qr_scale=None):
        return S.matmul(qr, self.w_q_b, qr.dtype)

    def _fused_qnorm_rope_kv_insert(self, q, kv, positions, attn_metadata):
        if not isinstance(attn_metadata, dict):
            return F.pad(q, (0, 0, 0, self.padded_heads - self.n_local_heads), value=0.0)
        swa_metadata = attn_metadata[self.swa_cache_layer.prefix]
        cos_sin = self.rotary_emb.cos_sin_cache
        out = S.output(
            (q.shape[0], self.padded_heads, self.head_dim), q.dtype, q.device,
            lambda: F.pad(S.rope_last(S.rms_norm(q, None, self.eps), positions, cos_sin),
                          (0, 0, 0, self.padded_heads - self.n_local_heads), value=0.0))
        with S.kernel_region():
            S.ds_store(self.swa_cache_layer.kv_cache, swa_metadata.slot_mapping,
                       S.rope_last(kv.float(), positions, cos_sin))
        return out

'''

INDEXER_HEAD = '''

class DeepseekV4Indexer(nn.Module):

    def _wq_b_proj(self, qr, qr_scale=None):
        return S.matmul(qr, self.w_q_b, qr.dtype)

'''

COMP_HEAD = '''"""vLLM's DeepseekCompressor.forward / _compress_norm_rope_store, verbatim;
the kernels are stand-ins."""
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from vllm import _harness_standins as S
from vllm.forward_context import get_forward_context
from vllm.platforms import current_platform

_SAVE_PARTIAL_STATES_KERNEL = S.save_partial_states
compress_norm_rope_store_triton = S.compress_store


def compress_norm_rope_store_two_stage_triton(**kwargs):
    raise NotImplementedError("ROCm two-stage compressor: not part of the harness")


@dataclass
class CompressorMetadata:
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    token_to_req_indices: torch.Tensor | None = None
    num_decode_tokens: int | None = None
    c128_boundary: bool | None = None


class DeepseekCompressor(nn.Module):

'''

FLASHMLA_HEAD = '''"""vLLM's DeepseekV4FlashMLAAttention.forward_mqa / _forward_decode,
verbatim; FlashMLA, the global top-k, the prefill and o_proj are stand-ins."""
from typing import TYPE_CHECKING, ClassVar, cast

import torch

from vllm import _harness_standins as S
from vllm.forward_context import get_forward_context
from vllm.models.deepseek_v4.attention import DeepseekV4Attention
from vllm.models.deepseek_v4.common.ops import compute_global_topk_indices_and_lens
from vllm.utils.math_utils import round_up

from vllm import _harness_recording as R
from vllm import _harness_signatures as SIG

{kernels}

class DeepseekV4FlashMLAMetadata:  # cast() target only
    pass


class _DummyRunWorkspace:
    """vLLM's workspace manager, as forward_mqa's dummy-run branch uses it (a
    reservation for later steps; the harness reserves nothing)."""

    def get_simultaneous(self, *specs):
        return None


def current_workspace_manager():
    return _DummyRunWorkspace()


class DeepseekV4FlashMLAAttention(DeepseekV4Attention):

    @classmethod
    def get_padded_num_q_heads(cls, num_heads: int) -> int:
        return 64 if num_heads <= 64 else 128

    # --- stand-ins (not vLLM's bodies) ------------------------------------------------

    def _o_proj(self, o, positions):
        S.maybe_yield_before_o_proj()
        return S.matmul(o.reshape(o.shape[0], -1), self.w_o, o.dtype)

    def _forward_prefill(self, q, positions, compressed_k_cache, swa_k_cache, output,
                         attn_metadata, swa_metadata):
        nd = swa_metadata.num_decode_tokens
        n = q.shape[0]
        parts = [(swa_k_cache, swa_metadata.prefill_swa_indices,
                  swa_metadata.prefill_swa_lens)]
        if self.compress_ratio == 4:
            local = self.topk_indices_buffer[nd : nd + n]
            g, lens = compute_global_topk_indices_and_lens(
                local, swa_metadata.token_to_req_indices[nd : nd + n],
                attn_metadata.block_table, attn_metadata.block_size // self.compress_ratio,
                swa_metadata.is_valid_token[nd : nd + n])
            parts.append((compressed_k_cache, g, lens))
        elif self.compress_ratio == 128:
            parts.append((compressed_k_cache, attn_metadata.c128a_prefill_topk_indices,
                          attn_metadata.c128a_prefill_topk_lens))
        S.nap(q)
        with S.kernel_region():
            output.copy_(S.sparse_attn(q, parts, self.scale, self.attn_sink))

    # --- vLLM's bodies ----------------------------------------------------------------

'''

COMMON_OPS = '''from vllm.models.deepseek_v4.common.ops.cache_utils import (
    compute_global_topk_indices_and_lens,
)
from vllm.models.deepseek_v4.common.ops.fused_indexer_q import fused_indexer_q_rope_quant
'''

# The kernel modules: vLLM's wrappers cut verbatim, its kernel objects recording
# stand-ins ({kernels}: ``kernel_globals``).
KERNEL_HEAD = '''import torch

from vllm import _harness_recording as R
from vllm import _harness_signatures as SIG
from vllm import _harness_standins as S
from vllm.platforms import current_platform
from vllm.utils.import_utils import has_cutedsl

MXFP4_BLOCK_SIZE = 32  # vLLM's fused_indexer_q.MXFP4_BLOCK_SIZE

{kernels}

'''

COMPRESSOR_CLASS = '''

class SparseAttnCompressorCuteDSL:
    def __init__(self, *, c4_store, c4_store_full, c128_compress, c128_store,
                 c128_store_full):
        # Shim: vLLM's constructor stores the five kernel objects.
        self.c4_store = c4_store
        self.c4_store_full = c4_store_full
        self.c128_compress = c128_compress
        self.c128_store = c128_store
        self.c128_store_full = c128_store_full

'''

COMPRESSOR_OBJECT = '''

_SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL = SparseAttnCompressorCuteDSL(
    c4_store=_SPARSE_ATTN_COMPRESS_NORM_ROPE_STORE_C4_KERNEL,
    c4_store_full=_SPARSE_ATTN_COMPRESS_NORM_ROPE_STORE_FULL_C4_KERNEL,
    c128_compress=_SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL,
    c128_store=_SPARSE_ATTN_NORM_ROPE_STORE_KERNEL,
    c128_store_full=_SPARSE_ATTN_NORM_ROPE_STORE_FULL_KERNEL,
)
'''


class _Plan:
    """The table's cuts of one build, handed out per class section (each
    exactly once: a table symbol no section takes stops the build)."""

    def __init__(self, cuts: Cuts, version: str) -> None:
        self.cuts = cuts
        self.todo = table_cuts(version)

    def section(self, rel: str, cls: str | None, sep: str = "\n") -> str:
        """The cut bodies of class ``cls``'s methods in ``rel`` (``None``: the
        module-level definitions), in vLLM's source order."""
        mine = [(q, req) for q, req in self.todo[rel]
                if (q.rpartition(".")[0] == cls if cls else "." not in q)]
        self.todo[rel] = [x for x in self.todo[rel] if x not in mine]
        src = self.cuts.files[rel]

        def line(q: str) -> int:
            node = src.node(q)
            return getattr(node, "lineno", 1 << 30)

        mine.sort(key=lambda x: line(x[0]))
        texts = [self.cuts.get(rel, q, required=req) for q, req in mine]
        return sep.join(t for t in texts if t)

    def done(self) -> None:
        left = [f"{_module(rel)}:{q}" for rel, items in self.todo.items() for q, _ in items]
        if left:
            raise SystemExit(f"build_stub: the drift table names {', '.join(left)}, which no "
                             "class section of the stub takes (add one in build())")


def build(root: Path, out: Path) -> tuple[str, list[tuple[str, str, int, int]]]:
    version = _version(root)
    cuts = Cuts(root)
    plan = _Plan(cuts, version)
    files: dict[str, str] = {}
    hdr = HEADER.format(version=version)

    def put(rel: str, body: str) -> None:
        files[rel] = hdr + body

    put("vllm/__init__.py", INIT.format(version=version))
    put("vllm/envs.py", ENVS)
    put("vllm/logger.py", LOGGER)
    put("vllm/config/__init__.py", CONFIG)
    put("vllm/forward_context.py", FORWARD_CONTEXT)
    put("vllm/platforms/__init__.py", PLATFORMS)
    for pkg in ("vllm/utils", "vllm/compilation", "vllm/v1", "vllm/v1/worker", "vllm/models",
                "vllm/models/deepseek_v4", "vllm/models/deepseek_v4/nvidia",
                "vllm/models/deepseek_v4/nvidia/ops"):
        put(f"{pkg}/__init__.py", "")
    put("vllm/utils/import_utils.py", IMPORT_UTILS)
    put("vllm/utils/math_utils.py", MATH_UTILS)
    put("vllm/compilation/breakable_cudagraph.py",
        BCG_HEAD + plan.section(BCG, None, sep="\n\n"))
    put("vllm/utils/torch_utils.py", TORCH_UTILS)
    for rel in (MSU, UBATCH):  # whole, verbatim
        text = (root / rel).read_text(encoding="utf-8")
        cuts.log.append((f"{rel[:-3].replace('/', '.')} (whole file)", fingerprint_text(text), 1,
                         len(text.splitlines())))
        files[rel] = text
    put("vllm/models/deepseek_v4/common/__init__.py", "")
    put("vllm/models/deepseek_v4/common/ops/__init__.py", COMMON_OPS)
    signatures, _ = kernel_globals(root, "")
    put("vllm/_harness_signatures.py", signatures)

    def kernel_module(rel: str, body: str) -> None:
        put(rel, KERNEL_HEAD.format(kernels=kernel_globals(root, rel)[1]) + body)

    kernel_module(CACHE_UTILS, plan.section(CACHE_UTILS, None, sep="\n\n"))
    kernel_module(INDEXER_Q, plan.section(INDEXER_Q, None, sep="\n\n"))
    kernel_module(INDEXER_Q_CUTE, "")
    kernel_module(COMPRESS_CUTE, COMPRESSOR_CLASS
                  + plan.section(COMPRESS_CUTE, "SparseAttnCompressorCuteDSL")
                  + COMPRESSOR_OBJECT)
    put(ATTN, ATTN_HEAD + "    # --- vLLM's bodies " + "-" * 60 + "\n\n"
        + plan.section(ATTN, "DeepseekV4Attention")
        + INDEXER_HEAD + plan.section(ATTN, "DeepseekV4Indexer"))
    put(COMP, COMP_HEAD + plan.section(COMP, "DeepseekCompressor"))
    put(FLASHMLA, FLASHMLA_HEAD.format(kernels=kernel_globals(root, FLASHMLA)[1])
        + plan.section(FLASHMLA, "DeepseekV4FlashMLAAttention"))
    plan.done()
    if out.exists():
        shutil.rmtree(out)
    for rel, text in files.items():
        p = out / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    shutil.copyfile(HERE / "standins.py", out / "vllm/_harness_standins.py")
    shutil.copyfile(HERE / "recording.py", out / "vllm/_harness_recording.py")
    lines = [f"# vLLM {version} bodies cut by tools/cuda_graph/build_stub.py from {root}",
             "# symbol  fingerprint  lines"]
    lines += [f"{sym}  {fp}  {a}-{b}" for sym, fp, a, b in cuts.log]
    lines += [f"# substituted: {x}" for x in cuts.substituted]
    (out / "FINGERPRINTS.txt").write_text("\n".join(lines) + "\n")
    for x in cuts.substituted:
        print(f"  substituted in {x}")
    return version, cuts.log


def known_fingerprints(version: str) -> dict[str, str]:
    """The CUDA layer's recorded fingerprints for this minor (its drift table;
    empty for a minor it does not know)."""
    minor = _minor(version)
    return {sym: hashes[minor] for sym, (_, hashes) in drift_table().items()
            if hashes.get(minor) is not None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--vllm-src", help="directory holding the vllm package (its parent)")
    src.add_argument("--wheel", help="a vllm wheel file")
    ap.add_argument("--out", required=True, help="output folder (replaced)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.wheel:
            root = Path(tmp)
            with zipfile.ZipFile(args.wheel) as z:
                names = [n for n in z.namelist()
                         if n in NEEDED or (n.startswith("vllm-") and n.endswith("METADATA"))]
                z.extractall(root, names)
        else:
            root = Path(args.vllm_src)
            if (root / "vllm" / "__init__.py").exists():
                pass
            elif (root / "__init__.py").exists() and root.name == "vllm":
                root = root.parent
            else:
                raise SystemExit(f"build_stub: no vllm package under {root}")
        out = Path(args.out)
        version, log = build(root, out)
    known = known_fingerprints(version)
    print(f"build_stub: vLLM {version} -> {out}")
    for sym, fp, a, b in log:
        want = known.get(sym)
        note = "" if want is None else ("  (= layer/cuda.py VLLM_DRIFT)" if want == fp
                                        else f"  (layer/cuda.py VLLM_DRIFT: {want})")
        print(f"  {fp}  {sym}  lines {a}-{b}{note}")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"build_stub: {size / 1024:.0f} KiB written")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sys.exit(main())
