# SPDX-License-Identifier: Apache-2.0
"""Record, subset and verify golden calls of vLLM's DeepSeek-V4 C++ CPU kernels.

The files (format: ``tests/data/golden/README.md``) hold the inputs and outputs
of ``torch.ops._C.<op>`` for the ops of
:data:`vllm_dsv4_backend.vllm_compat.cpu_ops.OPS`, compacted to a few token
rows and cache blocks so they replay exactly; the torch fallbacks of
``cpu_ops`` are tested against them on machines that cannot load the real
kernels (``tests/core/test_golden_kernels.py``).

Commands::

    record  --out DIR [--dry-run]   in-process LLM(...) greedy generation of
                                    configs/tiny-dsv4 with every op wrapped
                                    (needs vLLM's AVX512-BF16 kernel library)
    subset  --src DIR --dst DIR     copy the curated test subset out of a full
                                    recording (slicing what is too big)
    verify  [DIR]                   replay every file through torch.ops._C,
                                    bit for bit (default: tests/data/golden)
    selftest --src DIR              run the recorder's compaction on the
                                    calls of a recording and verify the result

``record``/``verify``/``selftest`` import vLLM (which loads its ``_C``
library) and refuse to run on torch fallbacks; ``subset`` and ``--dry-run``
need torch only. Run from the project root after ``source scripts/env.sh``.
How a call is cut to a few rows and blocks (the per-op layout and the
compaction) is ``scripts/golden_compact.py``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# This file runs as a script: its folder is on sys.path.
from golden_compact import (  # noqa: E402
    LAYOUT,
    as_rows_ref,
    compact_storages,
    cut_cache_outputs,
    default_rows,
    keep_rows,
    restrict_blocks,
    rope_rows,
)

from vllm_dsv4_backend.vllm_compat.cpu_ops import OPS, FallbackOp  # noqa: E402

DEFAULT_SRC = ROOT.parent / "shared" / "golden" / "vllm-0.32.0-cpu-avx512"
DEFAULT_DST = ROOT / "tests" / "data" / "golden"
MODEL_DIR = ROOT / "configs" / "tiny-dsv4"


def _load_golden_io() -> Any:
    """``tests/data/golden/golden_io.py`` (the loader the tests use), by path."""
    path = DEFAULT_DST / "golden_io.py"
    spec = importlib.util.spec_from_file_location("dsv4_golden_io", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gio = _load_golden_io()
OPS_BY_NAME: dict[str, FallbackOp] = {op.name: op for op in OPS}


# ----------------------------------------------------------------------------
# bit-exact comparison
# ----------------------------------------------------------------------------
def same_bits(a: Any, b: Any, nan_mask: bool = False) -> bool:
    """Bit equality of two tensors (NaN positions of ``b`` skipped if ``nan_mask``)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if nan_mask and b.is_floating_point():
        m = ~torch.isnan(b.float())
        return torch.equal(a.float()[m].view(torch.int32), b.float()[m].view(torch.int32)) and (
            a.dtype == b.dtype
        )
    ab = a.contiguous().reshape(-1).view(torch.uint8)
    bb = b.contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(ab, bb)


def replay_real(
    d: dict[str, Any], op: str, real: Any = None, *, other_isa: bool = False
) -> list[str]:
    """Replay one loaded file through ``torch.ops._C.<op>`` (or ``real``); the
    problems found. ``other_isa``: this CPU's AMX support differs from the
    recording machine's, so the GEMM-bound ops may differ within
    ``golden_io.ISA_SENSITIVE`` (every other op still bit for bit)."""
    fop = OPS_BY_NAME[op]
    real = getattr(torch.ops._C, op) if real is None else real
    outs, after = gio.call(real, fop.schema, d, unpacked_mat2=False)
    problems = []
    for name, want in d["outputs"].items():
        got = outs.get(name)
        if same_bits(got, want, nan_mask=op == "fp8_paged_mqa_logits_cpu"):
            continue
        why = gio.isa_mismatch(op, got, want) if other_isa else "bits differ"
        if why is not None:
            problems.append(f"output {name} differs ({why})")
    mutated = set(gio.mutated_arg_names(fop.schema))
    for name, v in d["args"].items():
        if name not in mutated and isinstance(v, torch.Tensor) and not same_bits(after[name], v):
            problems.append(f"read-only arg {name} was modified")
    return problems


def import_real_kernels() -> None:
    """Import vLLM (loads its ``_C`` kernel library) and refuse torch fallbacks."""
    import vllm  # noqa: F401
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    from vllm_dsv4_backend.vllm_compat import cpu_ops

    missing = cpu_ops.missing_ops()
    fallbacks = cpu_ops.registered()
    if missing or fallbacks:
        raise SystemExit(
            f"vLLM's AVX512-BF16 kernel library is not loaded (missing {missing}, torch "
            f"fallbacks {fallbacks}): golden calls must come from the real C++ kernels"
        )


# ----------------------------------------------------------------------------
# subset: the curated test copy
# ----------------------------------------------------------------------------
# Source files (names in the full recording) copied into tests/data/golden, per
# op: one call per phase where it fits the size budget, the small ones first.
SUBSET: dict[str, list[str]] = {
    "convert_weight_packed": ["000", "001"],
    "bmm_cpu": ["000", "001", "004"],
    "fused_qnorm_rope_kv_insert_cpu": ["000", "003"],
    "inverse_gptj_rope_o_proj_cpu": ["000", "002", "003"],
    "flash_mla_with_kvcache_cpu": ["001", "004", "005"],
    "save_partial_states_cpu": ["000", "003", "012"],
    "compress_norm_rope_store_cpu": ["000", "008"],
    "compress_norm_rope_store_indexer_cpu": ["000", "002", "004"],
    "hc_pre_fused_cpu": ["000", "004", "016"],
    "hc_post_fused_cpu": ["000", "004", "005", "016"],
    "hc_head_fused_cpu": ["000", "001", "004"],
    "biased_topk_cpu": ["000", "002", "006", "008"],
    "hash_topk_cpu": ["000", "001", "003", "004"],
    "fused_indexer_q_rope_quant_cpu": ["000", "001"],
    "fp8_paged_mqa_logits_cpu": ["000", "001"],
    "topk_transform_512_cpu": ["000", "001", "002"],
}
# Calls cut further to these rows (indices into the recorded rows). b3 prefill
# rows 0, 6, 13, 14, 15 are positions 0, 128, 2048, 2175, 2197 (the last);
# b3 decode rows 0, 2 are positions 20 and 2198. flash_mla keeps short rows in
# prefill (a long row reads ~9 compressed blocks of 37 KB) and the long one in
# decode; top-k keeps rows above and at index_topk.
_B3_PREFILL = [0, 6, 13, 15]
SUBSET_ROWS: dict[tuple[str, str], list[int]] = {
    ("fused_qnorm_rope_kv_insert_cpu", "000"): _B3_PREFILL,
    ("inverse_gptj_rope_o_proj_cpu", "000"): _B3_PREFILL,
    ("flash_mla_with_kvcache_cpu", "001"): [0, 6],
    ("flash_mla_with_kvcache_cpu", "004"): [0, 2],
    ("flash_mla_with_kvcache_cpu", "005"): [2],
    ("fused_qnorm_rope_kv_insert_cpu", "003"): [0, 2],
    ("fused_indexer_q_rope_quant_cpu", "000"): _B3_PREFILL,
    ("fp8_paged_mqa_logits_cpu", "000"): _B3_PREFILL,
    ("topk_transform_512_cpu", "000"): [0, 6, 13, 14, 15],
    ("compress_norm_rope_store_cpu", "000"): [0, 7],  # positions 3 and 2047 (both compress)
    ("compress_norm_rope_store_cpu", "008"): [1],  # the row that compresses (pos 127)
}
DEDUPE_BYTES = 16384  # tensors this big seen in several copied calls are stored once
WO_A_ROWS = 32  # output rows of wo_a kept (the VNNI packing works in blocks of 32 rows)


def _slice_wo_a(d: dict[str, Any], op: str, shared: dict[str, torch.Tensor]) -> list[str]:
    """Cut ``wo_a`` ([G, N, K], packed per 32 rows of N) to its first 32 rows of N,
    exactly: the packed prefix is the packing of the unpacked prefix (checked
    against the real op by ``verify``), and ``bmm_cpu``'s output columns are
    independent."""
    n = WO_A_ROWS
    if op == "convert_weight_packed" and d["meta"]["kind"] == "linear":
        w, p = d["args"]["weight"], d["outputs"]["return"]
        d["args"]["weight"] = w[:n].clone()
        d["outputs"]["return"] = p.reshape(-1)[: n * w.shape[1]].reshape(n, w.shape[1]).clone()
        return [f"weight cut to its first {n} rows (packed output: the matching prefix)"]
    unpacked = d["extra"]["mat2_unpacked"] if op == "bmm_cpu" else d["args"]["weight"]
    packed = d["args"]["mat2"] if op == "bmm_cpu" else d["outputs"]["return"]
    g, _, k = unpacked.shape
    shared["wo_a_unpacked-n32"] = unpacked[:, :n].clone()
    shared["wo_a_packed-n32"] = packed.reshape(g, -1)[:, : n * k].reshape(g, n, k).clone()
    ref_u = {"__shared__": "_shared/wo_a_unpacked-n32.pt"}
    ref_p = {"__shared__": "_shared/wo_a_packed-n32.pt"}
    if op == "bmm_cpu":
        d["args"]["mat2"], d["extra"]["mat2_unpacked"] = ref_p, ref_u
        d["args"]["out"] = d["args"]["out"][:, :, :n].clone()
        d["outputs"]["out"] = d["outputs"]["out"][:, :, :n].clone()
        return [f"wo_a cut to its first {n} output rows (out: first {n} columns)"]
    d["args"]["weight"], d["outputs"]["return"] = ref_u, ref_p
    return [f"wo_a cut to its first {n} rows"]


def subset_one(src: Path, op: str, name: str, shared: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Load a source call, cut it as configured, return the dict to save."""
    d = copy.copy(gio.load(src / op / f"{name}.pt"))
    d["args"], d["outputs"] = dict(d["args"]), dict(d["outputs"])
    if "extra" in d:
        d["extra"] = dict(d["extra"])
    d["meta"] = dict(d["meta"])
    changes: list[str] = []
    if op in ("bmm_cpu", "convert_weight_packed"):
        changes += _slice_wo_a(d, op, shared)
    rows = SUBSET_ROWS.get((op, name))
    if rows is not None:
        r = torch.tensor(rows, dtype=torch.long)
        # Every row's slots are renumbered into the kept blocks (-1 where its block
        # is gone), so keep_rows can reset what the dropped rows wrote there.
        args, kept = restrict_blocks(op, d["args"], r)
        outputs = cut_cache_outputs(op, d["outputs"], kept)
        d["args"], d["outputs"] = keep_rows(op, args, outputs, r)
        meta_rows = d["meta"].get("rows")
        if meta_rows is not None:
            d["meta"]["rows"] = [meta_rows[i] for i in rows]
        if d["meta"].get("row_positions") is not None:
            d["meta"]["row_positions"] = [d["meta"]["row_positions"][i] for i in rows]
        compact = d["meta"].get("compact") or {}
        for cname, blocks in kept.items():
            if isinstance(compact.get(cname), dict):
                ob = compact[cname]["orig_blocks"]
                compact[cname] = {**compact[cname], "orig_blocks": [ob[i] for i in blocks.tolist()]}
        changes.append(f"rows cut to recorded rows {rows} (caches to the blocks they use)")
    for tname in LAYOUT[op].rope:
        table = d["args"][tname]
        rr = rope_rows(op, d["args"])
        d["args"][tname] = as_rows_ref(table, rr)
        changes.append(
            f"{tname}: only the {rr.numel()} rows at the call's positions stored (NaN elsewhere)"
        )
    d["meta"]["golden_subset"] = {
        "source": f"shared/golden/{src.name}/{op}/{name}.pt",
        "changes": changes,
    }
    return d


def _digest(t: torch.Tensor) -> str:
    import hashlib

    h = hashlib.sha1(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


def _dedupe(loaded: dict[tuple[str, str], dict[str, Any]], shared: dict[str, torch.Tensor]) -> None:
    """Read-only args (weights such as ``hc_fn``) that several copied calls hold
    byte for byte go to ``_shared/<op>-<arg>-<sha1>.pt`` once (as the source does
    for its big tables)."""
    seen: dict[str, list[tuple[tuple[str, str], str]]] = {}
    for key, d in loaded.items():
        mutated = set(gio.mutated_arg_names(OPS_BY_NAME[key[0]].schema))
        for name, v in d["args"].items():
            if (
                isinstance(v, torch.Tensor)
                and name not in mutated
                and v.numel() * v.element_size() >= DEDUPE_BYTES
                and v.untyped_storage().nbytes() == v.numel() * v.element_size()
            ):
                seen.setdefault(_digest(v), []).append((key, name))
    for digest, uses in seen.items():
        if len(uses) < 2:
            continue
        (op, _), name = uses[0]
        sname = f"{op}-{name}-{digest}"
        shared[sname] = loaded[uses[0][0]]["args"][name]
        for key, n in uses:
            loaded[key]["args"][n] = {"__shared__": f"_shared/{sname}.pt"}
            loaded[key]["meta"]["golden_subset"]["changes"].append(
                f"{n}: stored once in _shared/{sname}.pt"
            )


def cmd_subset(ns: argparse.Namespace) -> int:
    src, dst = Path(ns.src), Path(ns.dst)
    src_manifest = json.loads((src / "MANIFEST.json").read_text())
    by_file = {e["file"]: e for e in src_manifest["files"]}
    shared: dict[str, torch.Tensor] = {}
    entries = []
    plan = [(op, n) for op in SUBSET for n in SUBSET[op]]
    if ns.dry_run:
        for op, n in plan:
            print(f"{op}/{n}.pt  {by_file[f'{op}/{n}.pt']['phase']}")
        return 0
    for op in SUBSET:
        shutil.rmtree(dst / op, ignore_errors=True)
    shutil.rmtree(dst / "_shared", ignore_errors=True)
    loaded = {(op, n): subset_one(src, op, n, shared) for op, n in plan}
    _dedupe(loaded, shared)
    for op, n in plan:
        d = loaded[(op, n)]
        out = dst / op / f"{n}.pt"
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(d, out)
        src_e = by_file[f"{op}/{n}.pt"]
        e = {
            k: src_e.get(k)
            for k in (
                "op",
                "file",
                "workload",
                "phase",
                "engine_step",
                "decode_step",
                "layer",
                "compress_ratio",
                "kind",
            )
        }
        e["rows"] = d["meta"].get("row_positions")
        e["source"] = d["meta"]["golden_subset"]["source"]
        e["changes"] = d["meta"]["golden_subset"]["changes"]
        e["bytes"] = out.stat().st_size
        e["source_fallback_deviation"] = src_e.get("fallback")
        entries.append(e)
    (dst / "_shared").mkdir(parents=True, exist_ok=True)
    for name, t in shared.items():
        torch.save(t, dst / "_shared" / f"{name}.pt")
    shutil.copyfile(src / "e2e_vllm_layer.json", dst / "e2e_vllm_layer.json")
    manifest = {
        "what": "subset of " + src_manifest["what"],
        "source": f"shared/golden/{src.name}",
        "vllm": src_manifest["vllm"],
        "torch": src_manifest["torch"],
        "cpu_isa": _recorded_isa(src, src_manifest),
        "made_by": "scripts/record_golden.py subset",
        "shared": sorted(f"_shared/{n}.pt" for n in shared),
        "files": entries,
    }
    (dst / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    print(f"wrote {len(entries)} calls to {dst} ({total / 2**20:.2f} MiB in the folder)")
    return 0


# ----------------------------------------------------------------------------
# verify
# ----------------------------------------------------------------------------
def _iter_files(folder: Path) -> Iterator[tuple[str, Path]]:
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    for e in manifest["files"]:
        yield e["op"], folder / e["file"]


def _recorded_isa(src: Path, src_manifest: dict[str, Any]) -> dict[str, bool]:
    """The recording machine's ``cpu_isa``: its manifest's, else its README's flags line
    (recordings made before the manifest carried it)."""
    if "cpu_isa" in src_manifest:
        return src_manifest["cpu_isa"]
    readme = (src / "README.md").read_text() if (src / "README.md").exists() else ""
    line = next((ln for ln in readme.splitlines() if "CPU flags" in ln), None)
    if line is None:
        raise SystemExit(f"{src}: neither MANIFEST.json cpu_isa nor a 'CPU flags' README line")
    flags = set(line.replace("`", " ").split())
    return {"avx512_bf16": "avx512_bf16" in flags, "amx_tile": "amx_tile" in flags}


def cmd_verify(ns: argparse.Namespace) -> int:
    folder = Path(ns.dir)
    torch.set_num_threads(ns.threads)
    import_real_kernels()
    other_isa = not gio.same_isa_as_recording(folder)
    if other_isa:
        print(
            f"this CPU ({gio.cpu_isa()}) is not of the recording's ISA: "
            f"{sorted(gio.ISA_SENSITIVE)} are checked within golden_io.ISA_SENSITIVE"
        )
    bad = 0
    n = 0
    for op, path in _iter_files(folder):
        n += 1
        problems = replay_real(gio.load(path), op, other_isa=other_isa)
        if problems:
            bad += 1
            print(f"FAIL {path.relative_to(folder)}: {'; '.join(problems)}")
        elif ns.verbose:
            print(f"ok   {path.relative_to(folder)}")
    how = "bit for bit" + (" (the ISA-sensitive ops within their bound)" if other_isa else "")
    print(f"{n - bad}/{n} files reproduce every recorded output {how}")
    return 1 if bad else 0


# ----------------------------------------------------------------------------
# record
# ----------------------------------------------------------------------------
ENGINE = dict(
    load_format="dummy",
    tokenizer_mode="hf",
    kv_cache_dtype="fp8",
    enforce_eager=True,
    max_model_len=4096,
    max_num_batched_tokens=4096,
    seed=0,
    attention_backend="FLASHMLA_SPARSE_DSV4",
)
ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_DSV4_ATTN_IMPL": "vllm",
}
SAMPLING = dict(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True, seed=0)


def workloads(vocab: int = 512, index_topk: int = 512) -> dict[str, list[list[int]]]:
    """The golden README's prompts: b3 (as tests/vllm/test_parity.py) and b8."""
    import random

    rng = random.Random(0)
    b3 = [[rng.randrange(16, vocab) for _ in range(n)] for n in (20, 300, 4 * index_topk + 150)]
    rng = random.Random(1)
    b8 = [[rng.randrange(16, vocab) for _ in range(n)] for n in (1, 4, 7, 16, 33, 64, 127, 130)]
    return {"b3": b3, "b8": b8}


@dataclass
class Recorder:
    """Wraps ``torch.ops._C.<op>``: records calls of the chosen steps, compacted."""

    out: Path
    decode_steps: tuple[int, ...]
    max_calls: int
    max_rows: int
    phase: str = "load"  # "<workload>-prefill" / "<workload>-decode" / "load"
    step: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    taken: dict[str, int] = field(default_factory=dict)
    files: list[dict[str, Any]] = field(default_factory=list)
    originals: dict[str, Any] = field(default_factory=dict)
    rows_fn: Callable[[list[int] | None, int], list[int]] = default_rows

    def wanted(self, op: str) -> bool:
        # Load time and prefill steps: every call (up to max_calls); decode: the
        # chosen steps only.
        ok = self.phase == "load" or self.phase.endswith("-prefill")
        ok = ok or self.step in self.decode_steps
        key = f"{op}|{self.phase}|{self.step}"
        return ok and self.taken.get(key, 0) < self.max_calls

    def wrap(self, fop: FallbackOp) -> Callable[..., Any]:
        real = getattr(torch.ops._C, fop.name)
        names = gio.schema_arg_names(fop.schema)

        def wrapper(*a: Any, **kw: Any) -> Any:
            key = f"{fop.name}|{self.phase}"
            self.counts[key] = self.counts.get(key, 0) + 1
            if not self.wanted(fop.name):
                return real(*a, **kw)
            args = dict(zip(names, a))
            args.update(kw)
            return self.capture(fop, real, args)

        wrapper.__wrapped__ = real  # type: ignore[attr-defined]
        return wrapper

    def capture(self, fop: FallbackOp, real: Any, args: dict[str, Any]) -> Any:
        op = fop.name
        lay = LAYOUT[op]
        num = None
        for n, dim in lay.rows_in.items():
            if isinstance(args.get(n), torch.Tensor):
                num = args[n].shape[dim]
                break
        pos = args.get("positions")
        pos_list = pos.tolist() if isinstance(pos, torch.Tensor) else None
        if num is None or num <= self.max_rows:
            rows = list(range(num or 0))
        else:
            rows = self.rows_fn(pos_list, num)
        r = torch.tensor(rows, dtype=torch.long)
        # Caches: only the blocks the kept rows use, before and after the call.
        before, kept = restrict_blocks(op, args, r) if lay.caches else (dict(args), {})
        before = gio.clone_args(before)  # snapshot (views of one buffer stay views)
        ret = real(*[args[n] for n in gio.schema_arg_names(fop.schema)])
        after = gio.outputs_of(ret, args, fop.schema)
        after = cut_cache_outputs(op, {k: v for k, v in after.items()}, kept)
        after = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in after.items()}
        if op == "fp8_paged_mqa_logits_cpu":
            # Columns past seq_len are never written (torch.empty memory): NaN.
            logits = after["return"]
            cols = torch.arange(logits.shape[1]).unsqueeze(0)
            logits[cols >= args["seq_lens"].long().unsqueeze(1)] = float("nan")
        if num is not None and len(rows) < num:
            before, after = keep_rows(op, before, after, r)
        for tname in lay.rope:
            before[tname] = as_rows_ref(before[tname], rope_rows(op, before))
        before, after = compact_storages(before), compact_storages(after)
        key = f"{op}|{self.phase}|{self.step}"
        self.taken[key] = self.taken.get(key, 0) + 1
        idx = sum(1 for f in self.files if f["op"] == op)
        rel = f"{op}/{idx:03d}.pt"
        meta = {
            "op": op,
            "schema": fop.schema,
            "phase": self.phase,
            "engine_step": self.step,
            "call_index_in_step": self.taken[key] - 1,
            "rows": rows if num is not None and len(rows) < num else None,
            "row_positions": [pos_list[i] for i in rows] if pos_list else None,
            "compact": {k: {"orig_blocks": v.tolist()} for k, v in kept.items()},
        }
        (self.out / op).mkdir(parents=True, exist_ok=True)
        torch.save({"args": before, "outputs": after, "meta": meta}, self.out / rel)
        self.files.append(
            {
                "op": op,
                "file": rel,
                "phase": self.phase,
                "engine_step": self.step,
                "rows": meta["rows"],
            }
        )
        return ret

    def install(self) -> None:
        for fop in OPS:
            self.originals[fop.name] = getattr(torch.ops._C, fop.name)
            setattr(torch.ops._C, fop.name, self.wrap(fop))

    def uninstall(self) -> None:
        for name, packet in self.originals.items():
            setattr(torch.ops._C, name, packet)


def cmd_record(ns: argparse.Namespace) -> int:
    out = Path(ns.out)
    decode_steps = tuple(int(s) for s in ns.decode_steps.split(","))
    plan = {
        "model": str(MODEL_DIR.relative_to(ROOT)),
        "engine": ENGINE,
        "env": ENV,
        "sampling": SAMPLING,
        "workloads": {k: [len(p) for p in v] for k, v in workloads().items()},
        "ops": [op.name for op in OPS],
        "decode_steps": decode_steps,
        "max_calls_per_op_and_step": ns.max_calls,
        "max_rows_uncut": ns.max_rows,
        "out": str(out),
    }
    if ns.dry_run:
        print(json.dumps(plan, indent=1))
        return 0
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    torch.set_num_threads(1)
    import_real_kernels()
    import vllm
    from vllm import LLM, SamplingParams

    vllm.plugins.load_general_plugins()
    out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(out, decode_steps, ns.max_calls, ns.max_rows)
    rec.install()
    e2e: dict[str, Any] = {
        "model": plan["model"],
        "engine": ENGINE,
        "env": ENV,
        "sampling": SAMPLING,
        "workloads": {},
    }
    try:
        llm = LLM(model=str(MODEL_DIR), **ENGINE)
        engine = llm.llm_engine
        params = SamplingParams(**SAMPLING)
        for wname, prompts in workloads().items():
            for i, p in enumerate(prompts):
                engine.add_request(f"{wname}-{i}", {"prompt_token_ids": p}, params)
            finished: dict[str, Any] = {}
            rec.step = 0
            while engine.has_unfinished_requests():
                rec.phase = f"{wname}-prefill" if rec.step == 0 else f"{wname}-decode"
                for o in engine.step():
                    if o.finished:
                        finished[o.request_id] = o
                rec.step += 1
            outs = []
            for i in range(len(prompts)):
                rid = f"{wname}-{i}"
                # vLLM may suffix the ids it hands back; match on the prefix too.
                key = next(r for r in finished if r == rid or r.startswith(rid + "-"))
                c = finished[key].outputs[0]
                outs.append(
                    {
                        "tokens": list(c.token_ids),
                        "logprobs": [
                            {str(t): lp.logprob for t, lp in step.items()}
                            for step in (c.logprobs or [])
                        ],
                    }
                )
            e2e["workloads"][wname] = {
                "prompt_lengths": [len(p) for p in prompts],
                "prompts": prompts,
                "outputs": outs,
            }
    finally:
        rec.uninstall()
    (out / "e2e_vllm_layer.json").write_text(json.dumps(e2e, indent=1) + "\n")
    manifest = {
        "what": "golden calls of vLLM's DeepSeek-V4 C++ CPU kernels",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "cpu_isa": gio.cpu_isa(),
        "call_counts_in_run": rec.counts,
        "files": rec.files,
        "plan": plan,
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    never = sorted({op.name for op in OPS} - {f["op"] for f in rec.files})
    print(f"recorded {len(rec.files)} calls into {out}; ops never recorded: {never or 'none'}")
    return 0


# ----------------------------------------------------------------------------
# selftest: the recorder's capture path on recorded calls
# ----------------------------------------------------------------------------
def cmd_selftest(ns: argparse.Namespace) -> int:
    """Each source call plays the role of a live call: the recorder captures it
    (cutting rows down to ``--max-rows``), and the captured file must replay bit
    for bit through the real op. Exercises block restriction, row cutting,
    entry resets and the cos/sin row tables without starting an engine."""
    src = Path(ns.src)
    torch.set_num_threads(1)
    import_real_kernels()
    tmp = Path(ns.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    rec = Recorder(tmp, (0,), 10**9, ns.max_rows)
    if ns.first_last:
        rec.rows_fn = lambda _pos, num: sorted({0, num - 1})
    rec.phase = "selftest-prefill"
    bad = n = 0
    rec.install()  # through the wrappers vLLM's calls would go through
    try:
        for op, path in _iter_files(src):
            if ns.op and op != ns.op:
                continue
            d = gio.load(path)
            args = gio.clone_args(d["args"])
            before = len(rec.files)
            getattr(torch.ops._C, op)(
                *[args[a] for a in gio.schema_arg_names(OPS_BY_NAME[op].schema)]
            )
            n += 1
            if len(rec.files) != before + 1:
                bad += 1
                print(f"FAIL {path.name} {op}: the wrapper recorded nothing")
                continue
            problems = replay_real(gio.load(tmp / rec.files[-1]["file"]), op, rec.originals[op])
            if problems:
                bad += 1
                print(f"FAIL {path.relative_to(src)}: {'; '.join(problems)}")
    finally:
        rec.uninstall()
    print(f"selftest: {n - bad}/{n} captured calls replay bit for bit (max_rows={ns.max_rows})")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record a golden set (needs vLLM's AVX512-BF16 kernels)")
    r.add_argument("--out", default=str(ROOT / ".scratch" / "golden-record"))
    r.add_argument("--decode-steps", default="1,4", help="decode engine steps to record")
    r.add_argument("--max-calls", type=int, default=4, help="calls per op and step")
    r.add_argument("--max-rows", type=int, default=8, help="calls with more rows are cut")
    r.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    s = sub.add_parser("subset", help="copy the test subset out of a full recording")
    s.add_argument("--src", default=str(DEFAULT_SRC))
    s.add_argument("--dst", default=str(DEFAULT_DST))
    s.add_argument("--dry-run", action="store_true", help="list the files, write nothing")
    v = sub.add_parser("verify", help="replay a folder through the real C++ ops, bit for bit")
    v.add_argument("dir", nargs="?", default=str(DEFAULT_DST))
    v.add_argument("--threads", type=int, default=1)
    v.add_argument("-v", "--verbose", action="store_true")
    t = sub.add_parser("selftest", help="the recorder's compaction on recorded calls")
    t.add_argument("--src", default=str(DEFAULT_SRC))
    t.add_argument("--tmp", default=str(ROOT / ".scratch" / "golden-selftest"))
    t.add_argument("--max-rows", type=int, default=2)
    t.add_argument("--op", default=None)
    t.add_argument(
        "--first-last",
        action="store_true",
        help="keep only the first and last row of calls above --max-rows",
    )
    ns = p.parse_args(argv)
    t0 = time.monotonic()
    rc = {
        "record": cmd_record,
        "subset": cmd_subset,
        "verify": cmd_verify,
        "selftest": cmd_selftest,
    }[ns.cmd](ns)
    print(f"({time.monotonic() - t0:.1f} s)", file=sys.stderr)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
