# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Dry run of the FlashMLA carry bundle (tools/gpu_flashmla) on CPU, so the GPU day's
one call does not fail on plumbing.

Built from this environment's vLLM 0.34 (``.venv-vllm034``: its wheel carries the
``_flashmla_C.abi3.so`` the box gets), into a temporary folder:

- the bundle: the ``.so`` and the rewired interface present with their manifest
  hashes, no vLLM import left, the ``.so``'s registered ``sparse_decode_fwd`` schema
  taking as many arguments as the interface passes, and the whole carried tree
  (the repository's travelling files + the bundle + the other carried folders) far
  under the 64 MiB a ``run`` call takes;
- ``check.py --dry-run`` in a subprocess with ``import vllm`` blocked (as on the box):
  its argument parsing, the bundle step, the real load of the ``.so`` (it cannot load
  on a CPU torch: reported as an ImportError raised by the interface's one rewired
  line, not a crash), then its cases through the real interface code over the CPU
  stand-in op, out= into a sentinel buffer, and the sanitizer child's plumbing;
- every case's CPU-side inputs legal for FlashMLA (its own checks, in its words).

Runs only under vLLM 0.34 (one of the tests/cuda environments) so CI runs it once.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.support.cuda_guard import require_vllm_cuda, vllm_minor

require_vllm_cuda()
if vllm_minor() != "0.34":
    pytest.skip("the FlashMLA bundle is built from vLLM 0.34 (runs in .venv-vllm034)",
                allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]

# tools/ is not installed: it imports from the checkout (pytest's pythonpath, the repo root).
from tools.gpu_flashmla import bundle as bundle_mod  # noqa: E402
from tools.gpu_flashmla import cases as C  # noqa: E402

RUN_LIMIT = 64 << 20  # what one device `run` call carries, the tree included
CARRIED = ("build/vllm_stub", ".scratch/gpu_bundle")  # the other carried folders


def _vllm_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")  # locates, does not import
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    vdir = _vllm_dir()
    if not (vdir / bundle_mod.SO_NAME).is_file():
        pytest.skip(f"this vLLM ({vdir}) has no {bundle_mod.SO_NAME}")
    dest = tmp_path_factory.mktemp("gpu_bundle") / "flashmla"
    bundle_mod.make_bundle(vdir, dest)
    return dest


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def test_bundle_contents_and_size(bundle_dir: Path) -> None:
    rep = bundle_mod.verify_bundle(bundle_dir)
    assert rep["ok"], rep["problems"]
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    assert manifest["vllm_version"] == metadata.version("vllm")
    pkg = bundle_dir / bundle_mod.PACKAGE
    so = pkg / bundle_mod.SO_NAME
    assert so.stat().st_size > 1 << 20  # the real kernels (about 3.9 MB), not a stub
    elf = manifest["elf"]
    assert "libcudart.so.13" in elf["needed"] and "libtorch_cuda.so" in elf["needed"]
    assert "sm_90a" in elf["arch_strings"]  # the H200's kernels are in it
    assert "aoti_torch_library_init_def" in elf["torch_stable_abi_symbols"]

    # One rewired line, nothing else from vLLM.
    (change,) = manifest["changes"]
    assert change["from"] == "import vllm._flashmla_C"
    iface = (pkg / bundle_mod.INTERFACE_NAME).read_text()
    original = (_vllm_dir() / bundle_mod.INTERFACE_SRC).read_text()
    assert iface.splitlines()[:change["line"] - 1] == original.splitlines()[:change["line"] - 1]
    assert iface.splitlines()[change["line"]:] == original.splitlines()[change["line"]:]
    assert not re.search(r"^\s*(import|from)\s+vllm\b", iface, re.M)

    # Symbol-level load check against this (CPU) torch: everything but the one CUDA
    # entry point resolves (the same check against the box's torch 2.11 libraries is
    # `bundle.py --verify --against ...`).
    import torch

    lib = Path(torch.__file__).parent / "lib"
    miss = bundle_mod.unresolved(elf, [lib / "libtorch_cpu.so", lib / "libtorch.so"])
    assert set(miss["torch_stable_abi_symbols"]) <= {"aoti_torch_get_current_cuda_stream"}

    # The .so and the interface belong together: the op's schema takes the arguments
    # the interface's sparse_decode_fwd call passes.
    (schema,) = [s for s in elf["op_schemas"] if s.startswith("sparse_decode_fwd(")]
    n_params = len(schema[schema.index("(") + 1: schema.index(") ->")].split(", "))
    calls = [n for n in ast.walk(ast.parse(iface)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "sparse_decode_fwd"]
    assert len(calls) == 1 and len(calls[0].args) == n_params == 14

    # Everything one `run` call carries: the repository's travelling files (tracked and
    # untracked-not-ignored), this bundle, and the other carried folders where built.
    ls = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                        capture_output=True, check=True).stdout.split(b"\0")
    tree = sum((REPO / f.decode()).stat().st_size for f in ls
               if f and (REPO / f.decode()).is_file())
    carried = sum(_dir_bytes(REPO / p) for p in CARRIED if (REPO / p).is_dir())
    total = tree + carried + rep["total_bytes"]
    assert rep["total_bytes"] < 8 << 20
    assert total < RUN_LIMIT // 2, (tree, carried, rep["total_bytes"])


def test_check_dry_run_with_vllm_blocked(bundle_dir: Path, tmp_path: Path) -> None:
    block = tmp_path / "novllm" / "vllm"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text('raise ImportError("vllm blocked: the GPU box has none")\n')
    out = tmp_path / "flashmla_check.json"
    env = dict(os.environ, PYTHONPATH=f"{block.parent}{os.pathsep}{REPO}", OMP_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1")
    env.pop("TORCH_CUDA_SANITIZER", None)
    # One case (padded rows, -1 holes, +-inf sinks, the C4A extra cache) keeps it fast;
    # every case's inputs pass FlashMLA's checks in test_every_case_is_flashmla_legal.
    p = subprocess.run(
        [sys.executable, str(REPO / "tools/gpu_flashmla/check.py"), "--dry-run",
         "--bundle", str(bundle_dir), "--out", str(out),
         "--cases", "c4a_h64_inf_sink"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    tail = (p.stdout + p.stderr)[-3000:]
    assert p.returncode == 0, tail
    rep = json.loads(out.read_text())
    assert rep["status"] == "DRY-RUN PASS", tail
    steps = rep["steps"]
    assert steps["env"]["vllm_importable"] is False
    assert steps["bundle"]["status"] == "OK"
    load = steps["load"]
    # A CPU torch cannot load the CUDA .so: reported, from the rewired import line.
    assert load["loaded"] is False and load["error"].startswith("ImportError")
    assert "ModuleNotFoundError" not in load["error"]
    assert load["symbols"]["torch_stable_abi_symbols"]["checked"] > 40
    assert load["symbols"]["cxx_symbols"]["checked"] > 20
    assert load["kernel"].startswith("cpu-standin")
    cases = steps["cases"]["cases"]
    assert set(cases) == {"c4a_h64_inf_sink"}
    for name, res in cases.items():
        for call in res["calls"]:
            assert call["ok"] and call["out_is_buffer"] and call["sentinel_kept"], name
            assert call["out"]["max_abs_err"] == 0.0  # the stand-in is the reference
        assert res["sched"]["num_splits"] == [res["facts"]["num_tokens"] + 1]
        # The stated tolerance holds for FlashMLA's bf16 rounding of the softmax weights.
        assert res["bf16_p_emulation"]["ok"], res["bf16_p_emulation"]
    # +inf sinks zero their heads: the comparison saw exact zeros there, and lse = +inf
    # on the padded rows only.
    assert cases["c4a_h64_inf_sink"]["calls"][0]["lse"]["inf_got"] == 2 * 64
    assert steps["graph"]["status"] == steps["streams"]["status"] == "SKIPPED"
    san = steps["sanitizer"]
    assert san["status"] == "PASS" and san["child"]["mode"] == "sanitizer-child", san
    assert san["child"]["cases"] == ["c4a_h64_inf_sink"]


def test_every_case_is_flashmla_legal() -> None:
    from tests.support.threads import one_thread

    # Small tensor ops: one thread (several oversubscribe the shared CI cores, ~5x slower).
    with one_thread():
        _check_every_case()


def _check_every_case() -> None:
    for spec in C.CASES:
        case = C.build_case(spec)
        assert C.flashmla_problems(case.q, case.swa_cache, case.swa_indices,
                                   case.extra_cache, case.extra_indices) == [], spec.name
        assert case.swa_cache.stride(0) % 576 == 0
        lens = case.swa_lens
        assert int(lens.max()) <= 128 and int((lens == 0).sum()) == spec.num_padded
        if case.extra_lens is not None:
            assert case.extra_indices is not None
            width = case.extra_indices.shape[-1]
            assert width % 128 == 0 and int(case.extra_lens.max()) <= width


def test_check_argument_parsing() -> None:
    from tools.gpu_flashmla import check

    args = check.parse_args(["--dry-run", "--cases", "swa_h64", "--bundle", "x"])
    assert args.dry_run and args.cases == "swa_h64" and os.path.isabs(args.bundle)
    with pytest.raises(SystemExit):
        check.parse_args(["--cases", "no_such_case"])
