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

Everything else is a small shim (forward context, logger, platform, envs,
``CUDAGraphMode``; their text is ``tools/cuda_graph/stub_shims.py``) or a
stand-in for a CUDA-only kernel or a module vLLM's bodies call
(``tools/cuda_graph/standins.py``, copied in as
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
# The repository root: the stub's own text (stub_shims.py), and the plugin's
# fingerprint normalisation and definition lookup (vLLM-free), so a cut body's
# printed fingerprint is the one the plugin's drift check computes.
sys.path.insert(0, str(HERE.parent.parent))
from tools.cuda_graph.stub_shims import (  # noqa: E402
    ATTN_HEAD,
    BCG_HEAD,
    COMMON_OPS,
    COMP_HEAD,
    COMPRESSOR_CLASS,
    COMPRESSOR_OBJECT,
    CONFIG,
    ENVS,
    FLASHMLA_HEAD,
    FORWARD_CONTEXT,
    HEADER,
    IMPORT_UTILS,
    INDEXER_HEAD,
    INIT,
    KERNEL_HEAD,
    LOGGER,
    MATH_UTILS,
    PLATFORMS,
    TORCH_UTILS,
)
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
