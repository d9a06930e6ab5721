# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Code the tests share (no test module imports another, nothing is loaded by path).

Import as ``from tests.support.<module> import ...`` (the repository root is on
``sys.path``: pytest's ``pythonpath = ["."]``, or :func:`worker_env` for a script).

- :mod:`.oracle`: float64 oracles of fp8_ds_mla and sparse MLA, FlashMLA's tolerance rule;
- :mod:`.indexer`: exact oracles and cases of the indexer K cache and ops;
- :mod:`.compressor_store`: compressor scenarios, their float64 oracle, byte helpers and
  the ``*_matches_cpu_op`` tests shared by tests/core (scalar transliteration) and
  tests/vllm (vLLM's C++ ops), collected where imported;
- :mod:`.high_block_ids`: the lazily mapped far buffer past 2**31 bytes and the checks
  of vLLM's CPU op conventions on it;
- :mod:`.mod4_sweep`: the prompt-length sweep (world, oracles, implementations);
- :mod:`.bi_world`: the batch-invariance C4-layer world, its work and schedules;
- :mod:`.families`: the buffer families, derived from the lease plan, and small configs;
- :mod:`.threads`: one intra-op thread (context manager and module fixture);
- :mod:`.stream_schedule`: the simulated-stream workspace program and #49236's layout;
- :mod:`.vllm_helpers`: helpers of the tests against a real vLLM (tiny engine, real C++
  kernels, worker scripts);
- :mod:`.served`: the load test's requests, targets and verdicts, shared by the server
  tests (load, tensor parallel, parallel layouts);
- :mod:`.patch_failures`: failure injection into the patch registry (worker side);
- :mod:`.safety`: the safety case's items, prompts and engine spec;
- :mod:`.cuda_guard`, :mod:`.layer_streams`: tests/cuda's module guard and the CUDA
  layer over simulated streams.

Modules imported by tests/core import torch and the plugin only, never vLLM (the suite
runs them with ``import vllm`` blocked); the others import vLLM lazily or say so.

Scripts under ``tests/`` that a test runs in a subprocess (``python <file>`` or
``python -c``) are outside pytest: their launcher passes ``env=worker_env(...)``, which
puts the repository root on ``PYTHONPATH`` (``vllm_helpers.run_script_report`` does it for
the test files that are their own worker).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root


def worker_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) with the repository root first on ``PYTHONPATH``,
    so a script launched from a test can ``import tests.support``."""
    env = dict(os.environ if base is None else base)
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + rest if rest else "")
    return env
