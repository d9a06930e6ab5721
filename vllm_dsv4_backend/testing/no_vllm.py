# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""pytest plugin: make ``import vllm`` fail, to prove ``tests/core`` is torch-only.

``scripts/test.sh`` runs ``tests/core`` a second time with
``DSV4_CORE_NO_VLLM=1 python -m pytest -p vllm_dsv4_backend.testing.no_vllm tests/core``.
Before any test module is collected, ``sys.modules["vllm"]`` is set to None,
so ``import vllm`` (and every ``vllm.*`` submodule) raises ``ImportError``, as
on a lent GPU whose image has no vLLM: a core module or test that imports
vLLM at module level then fails collection, and tests that need vLLM
(``pytest.importorskip("vllm")``) skip. Inert without the variable, so
loading the plugin by accident changes nothing.
"""

from __future__ import annotations

import os
import sys

import pytest

ENV = "DSV4_CORE_NO_VLLM"


def _enabled() -> bool:
    return os.environ.get(ENV, "").strip() == "1"


def pytest_configure(config: pytest.Config) -> None:
    if not _enabled():
        return
    loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
    if loaded:
        raise pytest.UsageError(f"{ENV}=1: vLLM was imported before the plugin ran: {loaded}")
    sys.modules["vllm"] = None  # type: ignore[assignment]


def pytest_report_header(config: pytest.Config) -> str | None:
    return f"{ENV}=1: import vllm is blocked (tests/core must be torch-only)" if _enabled() \
        else None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Nothing may have replaced the block (e.g. a test that restored sys.modules).
    if _enabled() and sys.modules.get("vllm") is not None:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\n{ENV}=1: vllm was imported despite the block", file=sys.stderr)
