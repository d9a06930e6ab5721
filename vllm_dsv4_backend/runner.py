# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Moved to :mod:`vllm_dsv4_backend.run` (split by job: config, gates, server, cli).

Kept so ``vllm_dsv4_backend.runner:main`` (console scripts installed before
the move) and ``from vllm_dsv4_backend import runner`` keep working. Note
that patching a name here does not reach the code in ``run``; patch
``vllm_dsv4_backend.run`` (what the benchmarks call through) instead.
"""

from __future__ import annotations

import sys

from vllm_dsv4_backend.run import *  # noqa: F403
from vllm_dsv4_backend.run import __all__ as _run_all
from vllm_dsv4_backend.run.config import _get  # noqa: F401  (tests read it)
from vllm_dsv4_backend.run.gates import verdict as _verdict  # noqa: F401

__all__ = list(_run_all)

if __name__ == "__main__":
    sys.exit(main())  # noqa: F405
