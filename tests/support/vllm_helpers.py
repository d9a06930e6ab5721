# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Small helpers shared by the tests against a real vLLM (tests/vllm, tests/safety).

Importing it loads neither vLLM nor torch: the helpers that need them import them when
called.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, worker_env
from vllm_dsv4_backend import run as R

# The tiny model's in-process engine (``vllm.LLM`` kwargs) in the tests that start one:
# configs/serve/tiny-dsv4-cpu.yaml's settings (dummy seeded weights, the shipped
# tokenizer, fp8 KV cache, eager, seed 0, the plugin's backend), with room for a whole
# 4096-token prompt in one step (MLA on CPU turns chunked prefill off). Tests extend
# it with their own keys; copy it (``{**TINY_ENGINE, ...}``), never change it in place.
TINY_ENGINE: dict[str, Any] = {
    "load_format": "dummy",
    "tokenizer_mode": "hf",
    "kv_cache_dtype": "fp8",
    "enforce_eager": True,
    "max_model_len": 4096,
    "max_num_batched_tokens": 4096,
    "seed": 0,
    "attention_backend": "FLASHMLA_SPARSE_DSV4",
}


def healthy(base_url: str, timeout: float = 10.0) -> bool:
    """Whether ``base_url/health`` answers 200 now."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def local_serve_config(path: Path) -> R.ServeConfig:
    """The serve config the server tests run, which must name a local model.

    The repo ships ``configs/serve/tiny-dsv4-cpu.yaml``; a missing file or a Hub model
    (``DSV4_TEST_SERVE_CONFIG`` pointing elsewhere, no network here) is a setup error that
    fails the test, never a silent skip.
    """
    if not path.is_file():
        pytest.fail(f"serve config {path} missing (DSV4_TEST_SERVE_CONFIG or the repo's "
                    "configs/serve/tiny-dsv4-cpu.yaml)")
    serve = R.load_serve_config(path)
    if serve.model_path is None and not Path(serve.model).exists():
        pytest.fail(f"serve config {path}: model {serve.model!r} is not a local directory "
                    "(these tests run offline)")
    return serve


# The DeepSeek-V4 ``torch.ops._C`` kernels the plugin's CPU layer calls (with vLLM's
# layer), all of them ops of ``vllm_compat.cpu_ops.OPS``: what the real-kernel tests run.
CPU_LAYER_KERNELS: tuple[str, ...] = (
    "flash_mla_with_kvcache_cpu",
    "fp8_paged_mqa_logits_cpu",
    "topk_transform_512_cpu",
    "fused_indexer_q_rope_quant_cpu",
    "fused_qnorm_rope_kv_insert_cpu",
    "save_partial_states_cpu",
    "compress_norm_rope_store_cpu",
    "compress_norm_rope_store_indexer_cpu",
)


def real_cpp_ops(names: Iterable[str]) -> Any:
    """``torch.ops._C`` with vLLM's real C++ kernels ``names`` (ops of
    ``cpu_ops.OPS``) loaded; skips otherwise.

    The skip is machine-dependent: only vLLM's AVX512-BF16 ``_C`` library ships the
    DeepSeek-V4 CPU kernels, so on a CPU without AVX512-BF16 the loaded library lacks
    them (or, once the plugin registered them, ``torch.ops._C.<name>`` is its torch
    fallback); there the tests of the real kernels skip, saying which ops and why.
    """
    import torch
    from vllm.platforms import current_platform

    from vllm_dsv4_backend.vllm_compat import cpu_ops

    names = list(names)
    unknown = set(names) - {op.name for op in cpu_ops.OPS}
    if unknown:
        raise ValueError(f"{sorted(unknown)} are not DeepSeek-V4 ops of cpu_ops.OPS")
    current_platform.import_kernels()
    absent = set(cpu_ops.missing_ops())
    missing = [n for n in names if n in absent]
    if missing:
        pytest.skip(f"vLLM's loaded kernel library lacks {missing}: the DeepSeek-V4 C++ "
                    "kernels are only in vLLM's AVX512-BF16 _C library (machine-dependent: "
                    "this CPU has no AVX512-BF16 or vLLM loaded another build)")
    fallback = [n for n in names if cpu_ops.is_fallback(n)
                or getattr(getattr(torch.ops._C, n), cpu_ops.FALLBACK_FLAG, False)]
    if fallback:
        pytest.skip(f"torch.ops._C.{fallback} are the plugin's torch fallbacks, not vLLM's "
                    "C++ kernels (registered where vLLM's library lacks them)")
    return torch.ops._C


def run_script_report(script: str | Path, args: Sequence[str], out: Path, timeout: float,
                      env: Mapping[str, str] | None = None) -> dict:
    """Run ``python script *args out`` from the repo root (a test file that is its own
    worker script) and return the JSON report it wrote to ``out``; asserts the report
    exists, with the tail of the worker's output. ``env`` defaults to this process's; the
    script gets :func:`tests.support.worker_env`'s ``PYTHONPATH`` (``tests`` importable)."""
    proc = subprocess.run([sys.executable, str(script), *args, str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env=worker_env(env))
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def run_module_report(module: str, spec: Any, d: Path, env: Mapping[str, str],
                      timeout: float, what: str = "worker") -> Any:
    """Run ``python -m module <d>/spec.json <d>/out.json`` (``spec`` written as JSON; cwd:
    the repository root; env: ``env`` through :func:`tests.support.worker_env`; output to
    ``<d>/worker.log``) and return the JSON report it wrote. A worker that exits non-zero or
    writes no report fails the test with ``what`` and its log's tail."""
    (d / "spec.json").write_text(json.dumps(spec))
    with open(d / "worker.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", module, str(d / "spec.json"),
                               str(d / "out.json")], cwd=ROOT, env=worker_env(env),
                              stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0 or not (d / "out.json").exists():
        pytest.fail(f"{what} failed (rc {proc.returncode}):\n"
                    + (d / "worker.log").read_text(errors="replace")[-6000:])
    return json.loads((d / "out.json").read_text())


def run_workers_at_once(script: str | Path, specs: Mapping[str, Any], d: Path,
                        envs: Mapping[str, Mapping[str, str]], timeout: float) -> dict[str, dict]:
    """Run ``python script <d>/<name>.json <d>/<name>-out.json`` for every ``name, spec``
    of ``specs`` at the same time (cwd: the repository root; env: ``envs[name]`` through
    :func:`tests.support.worker_env`) and return ``{name: report}``. Each worker's output
    goes to ``<d>/<name>.log``, a file, not a pipe: a pipe read only after another worker
    ends would stall this one once its engine logs fill the pipe's buffer. A worker that
    exits non-zero or writes no report fails the test with its log's tail; all are killed
    on the way out."""
    procs: dict[str, tuple[subprocess.Popen, Any]] = {}
    try:
        for name, spec in specs.items():
            (d / f"{name}.json").write_text(json.dumps(spec))
            log = open(d / f"{name}.log", "w")  # noqa: SIM115  (closed below)
            procs[name] = (subprocess.Popen(
                [sys.executable, str(script), str(d / f"{name}.json"),
                 str(d / f"{name}-out.json")],
                cwd=ROOT, env=worker_env(envs[name]), stdout=log,
                stderr=subprocess.STDOUT), log)
        reports = {}
        for name, (proc, _) in procs.items():
            rc = proc.wait(timeout=timeout)
            out = d / f"{name}-out.json"
            if rc != 0 or not out.exists():
                tail = (d / f"{name}.log").read_text(errors="replace")[-6000:]
                pytest.fail(f"worker {name} ({Path(script).name}) failed (rc {rc}):\n{tail}")
            reports[name] = json.loads(out.read_text())
        return reports
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


def exit_with_report(out_path: str | Path, report: dict) -> None:
    """End a worker script: write ``report`` as JSON to ``out_path`` (what
    :func:`run_script_report` returns), flush stdout and exit 0 at once, skipping the
    in-process engine's teardown."""
    Path(out_path).write_text(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)
