# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Exit codes and errors shared by the ``vllm-dsv4-run`` modules (stdlib only)."""

from __future__ import annotations

__all__ = [
    "EXIT_CONFIG",
    "EXIT_GATE_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_PASS",
    "EXIT_RUNTIME",
    "PREFIX",
    "ConfigError",
    "RunError",
]

EXIT_PASS = 0
EXIT_GATE_FAILED = 1
EXIT_CONFIG = 2
EXIT_RUNTIME = 3
EXIT_INTERRUPTED = 130

PREFIX = "[vllm-dsv4-run]"
"""Prefix of the runner's own progress lines (stderr)."""


class ConfigError(ValueError):
    """A config file or argument is malformed; the message names file and key."""


class RunError(RuntimeError):
    """The server, lm_eval or the benchmark failed; the message carries a log tail."""
