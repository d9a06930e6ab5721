# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm-dsv4-run``: serve a config, run lm_eval or ``vllm bench serve``
against it, gate or compare the results (stdlib + PyYAML; neither vLLM nor
lm_eval is imported: both run as subprocesses).

One module per job:

* :mod:`.config` — serve / eval / bench config files -> command lines, and
  :data:`~.config.TINY_SERVE_CONFIG`, the one tiny-server definition;
* :mod:`.gates` — lm_eval gates and bench comparisons (pass/fail);
* :mod:`.server` — :class:`~.server.ServerProcess`, the ``vllm serve``
  subprocess the runner, the benchmarks and the tests share;
* :mod:`.cli` — the command line (``main``), running lm_eval and the benchmark;
* :mod:`.common` — exit codes and errors.

The names below are the runner's API (``from vllm_dsv4_backend import run``).
"""

from __future__ import annotations

from vllm_dsv4_backend.run import cli, common, config, gates, server
from vllm_dsv4_backend.run.cli import *  # noqa: F403
from vllm_dsv4_backend.run.common import *  # noqa: F403
from vllm_dsv4_backend.run.config import *  # noqa: F403
from vllm_dsv4_backend.run.gates import *  # noqa: F403
from vllm_dsv4_backend.run.server import *  # noqa: F403

__all__ = sorted({*cli.__all__, *common.__all__, *config.__all__, *gates.__all__,
                  *server.__all__})
