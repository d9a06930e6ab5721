# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Small helpers shared by the tests against a real vLLM server (not a test module)."""

from __future__ import annotations

import importlib.util
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest

from vllm_dsv4_backend import runner as R


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


def load_core_module(filename: str, name: str) -> ModuleType:
    """A ``tests/core`` file as a module (tests/core is not a package), for the vLLM
    tests that reuse its case builders and oracles against vLLM's kernels."""
    path = Path(__file__).resolve().parents[1] / "core" / filename
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
