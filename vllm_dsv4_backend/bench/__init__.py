# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmarks (not tests): ``python -m vllm_dsv4_backend.bench.kernels`` times the sparse MLA
kernels; ``vllm-dsv4-bench`` (:mod:`.cli`) the eager region under the workspace policies, and
its ``layer-ab`` / ``e2e-layers`` / ``solo-identity`` commands the plugin's layer against
vLLM's own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def finish(result: dict[str, Any], json_path: str | None, text: str) -> int:
    """A comparison's last step: the JSON result to ``json_path`` (if given), the table to
    stdout; returns exit code 0."""
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    print(text)
    return 0
