# SPDX-License-Identifier: Apache-2.0
"""Load and replay the golden kernel calls of this folder (torch only, no vLLM).

The format is the one of ``shared/golden/vllm-0.32.0-cpu-avx512`` (its
``golden_io.py``, whose logic is copied here so the tests never read
``shared/`` at run time), plus one compact tensor reference that
``scripts/record_golden.py subset`` writes:

- ``{"__shared__": "_shared/<name>.pt"}``: a tensor stored once in this
  folder's ``_shared/``.
- ``{"__rows__": {"rows": [r] int64, "values": [r, ...], "shape": [R, ...]}}``:
  a table the op reads only at ``rows`` (the rotary cos/sin caches, read at the
  call's positions): materialized as ``[R, ...]`` with those rows and NaN
  everywhere else, so a read of any other row shows up as NaN in the replay.

File layout: ``{"args": {schema arg name: value}, "outputs": {...}, "meta":
{...}, ["extra": {...}]}``; see README.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

ROOT = Path(__file__).resolve().parent


def _materialize_rows(ref: dict[str, Any]) -> torch.Tensor:
    values: torch.Tensor = ref["values"]
    full = torch.full(tuple(ref["shape"]), float("nan"), dtype=values.dtype)
    full[ref["rows"]] = values
    return full


def _resolve(v: Any, root: Path) -> Any:
    if isinstance(v, dict) and "__shared__" in v:
        return torch.load(root / v["__shared__"], weights_only=True)
    if isinstance(v, dict) and "__rows__" in v:
        return _materialize_rows(v["__rows__"])
    if isinstance(v, dict):
        return {k: _resolve(x, root) for k, x in v.items()}
    return v


def load(path: str | Path) -> dict[str, Any]:
    """One call: ``{"args", "outputs", "meta", ["extra"]}`` with references resolved."""
    path = Path(path)
    d = torch.load(path, weights_only=False)
    root = path.parent.parent
    for k in ("args", "outputs", "extra"):
        if k in d:
            d[k] = _resolve(d[k], root)
    return d


def clone_args(args: dict[str, Any]) -> dict[str, Any]:
    """Fresh copies (the ops mutate their ``(a!)`` args); views of one buffer stay
    views of one buffer (``save_partial_states_cpu``'s ``kv``/``score``)."""
    memo: dict[tuple[int, int], torch.UntypedStorage] = {}
    out: dict[str, Any] = {}
    for k, v in args.items():
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key not in memo:
                memo[key] = torch.empty(0, dtype=torch.uint8).set_(st).clone().untyped_storage()
            out[k] = torch.empty(0, dtype=v.dtype).set_(
                memo[key], v.storage_offset(), v.shape, v.stride()
            )
        else:
            out[k] = v
    return out


def schema_arg_names(schema: str) -> list[str]:
    """``"(Tensor(a!) out, Tensor q, ...) -> ()"`` -> ``["out", "q", ...]``."""
    params = schema.split("->")[0].strip()[1:-1]
    return [p.strip().rsplit(" ", 1)[1] for p in params.split(",") if p.strip()]


def mutated_arg_names(schema: str) -> list[str]:
    """The ``(a!)``/``(b!)`` arguments of a schema (written in place by the op)."""
    params = schema.split("->")[0].strip()[1:-1]
    return [p.strip().rsplit(" ", 1)[1] for p in params.split(",") if "!)" in p]


def outputs_of(ret: Any, args: dict[str, Any], schema: str) -> dict[str, Any]:
    """The op's outputs under the recording's names: ``return`` (``return_0..`` for
    tuples) and every mutated argument after the call."""
    res: dict[str, Any] = {}
    if isinstance(ret, tuple | list):
        for i, r in enumerate(ret):
            res[f"return_{i}"] = r
    elif ret is not None:
        res["return"] = ret
    for name in mutated_arg_names(schema):
        if args.get(name) is not None:
            res[name] = args[name]
    return res


def call(
    impl: Any, schema: str, d: dict[str, Any], *, unpacked_mat2: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Replay one file through ``impl``: returns ``(outputs, cloned args after)``.

    ``unpacked_mat2``: ``bmm_cpu`` gets ``extra.mat2_unpacked`` (the torch
    fallback's ``convert_weight_packed`` is a plain copy, so it reads plain
    weights); the real kernel gets the recorded VNNI-packed ``mat2``.
    """
    args = clone_args(d["args"])
    if unpacked_mat2 and "mat2_unpacked" in d.get("extra", {}):
        args["mat2"] = d["extra"]["mat2_unpacked"].clone()
    ret = impl(*[args[n] for n in schema_arg_names(schema)])
    return outputs_of(ret, args, schema), args


class IsaBound(NamedTuple):
    """How far a replay may stray from the recording on a CPU of another matrix ISA.

    (A NamedTuple, not a dataclass: ``scripts/record_golden.py`` loads this file by path,
    outside ``sys.modules``, where ``@dataclass`` cannot resolve its module; the tests
    import it as ``tests.data.golden.golden_io``.)
    """

    max_diff_frac: float  # share of output elements that differ
    max_rel_l2: float  # ||got - want|| / ||want||
    max_abs_of_max: float  # max |got - want| / max |want|: about one bf16 ulp at the top


#: Ops whose C++ kernel runs its bf16 GEMMs on AMX tiles where the CPU has them and as
#: AVX512-BF16 dot products where it has not: the same products, summed in another order.
#: Bounds from the full recording (140 calls) replayed on an AMD EPYC with AVX512-BF16 and
#: no AMX (2026-12-02): flash_mla 9 of 15 calls differ, at most 83 of 65536 elements
#: (0.13%), rel L2 <= 1.1e-4, max |diff| <= 2.0e-3 x max |out|; bmm 2 of 5, at most 1 of
#: 2048 (0.05%), rel L2 <= 2.6e-4, max |diff| <= 2.9e-3 x max |out|. Every other op
#: reproduces the recording bit for bit there too. The bounds leave the torch fallback of
#: sparse MLA (rel L2 2.1e-3, most elements off) well outside.
ISA_SENSITIVE: dict[str, IsaBound] = {
    "flash_mla_with_kvcache_cpu": IsaBound(5e-3, 5e-4, 2**-7),
    "bmm_cpu": IsaBound(5e-3, 1e-3, 2**-7),
}


def cpu_isa() -> dict[str, bool]:
    """The ISA facts of this CPU that vLLM's CPU kernels dispatch on."""
    return {
        "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "amx_tile": bool(torch.cpu._is_amx_tile_supported()),
    }


def same_isa_as_recording(folder: Path = ROOT) -> bool:
    """True if this CPU takes the recording machine's kernel paths (AMX or not). A
    manifest without ``cpu_isa`` predates the field: those recordings ran on AMX."""
    rec = manifest(folder).get("cpu_isa", {})
    return bool(rec.get("amx_tile", True)) == cpu_isa()["amx_tile"]


def isa_mismatch(op: str, got: Any, want: Any) -> str | None:
    """Why ``got`` is outside ``op``'s :data:`ISA_SENSITIVE` bound (None: inside).

    For a replay on a CPU whose AMX support differs from the recording's; ops not in
    :data:`ISA_SENSITIVE` have no bound (only bit equality counts for them).
    """
    bound = ISA_SENSITIVE.get(op)
    if bound is None:
        return f"{op} has no ISA bound (bit for bit on AMX and non-AMX CPUs alike)"
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return f"got {type(got).__name__} {getattr(got, 'shape', '')}, want {tuple(want.shape)}"
    g, w = got.double(), want.double()
    if not bool(torch.isfinite(g).all()):
        return "non-finite output"
    frac = float((g != w).double().mean())
    rel = float((g - w).norm() / w.norm().clamp_min(1e-30))
    top = float((g - w).abs().max() / w.abs().max().clamp_min(1e-30)) if w.numel() else 0.0
    if frac > bound.max_diff_frac or rel > bound.max_rel_l2 or top > bound.max_abs_of_max:
        return (
            f"{frac:.2%} of elements differ (bound {bound.max_diff_frac:.2%}), "
            f"rel L2 {rel:.2e} (bound {bound.max_rel_l2:.0e}), "
            f"max |diff| {top:.2e} x max |out| (bound {bound.max_abs_of_max:.1e})"
        )
    return None


def manifest(folder: Path = ROOT) -> dict[str, Any]:
    return json.loads((folder / "MANIFEST.json").read_text())


def files(op: str | None = None) -> Iterator[tuple[dict[str, Any], Path]]:
    """``(manifest entry, path)`` of every copied call (of ``op`` if given)."""
    for entry in manifest()["files"]:
        if op is None or entry["op"] == op:
            yield entry, ROOT / entry["file"]
