# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared fixtures for tests against a real vLLM (CPU build) with this plugin.

``tiny_server`` (session scope) starts one ``vllm serve`` of the tiny model
on a free loopback port from the one tiny-server definition,
``configs/serve/tiny-dsv4-cpu.yaml`` (``vllm_dsv4_backend.run.TINY_SERVE_CONFIG``,
which ``scripts/serve_tiny.sh`` serves too: ``FLASHMLA_SPARSE_DSV4``, fp8 KV
cache, seeded dummy weights, eager, seed 0), through the runner's
``ServerProcess``, waits for ``/health`` and stops it at the end of the
session. Logs and the plugin's per-process marker files go to
``.scratch/tests/server-<pid>/``. Startup on a 2-core CPU takes minutes (it is
mostly imports); ``DSV4_SERVER_TIMEOUT`` (seconds, default 900) bounds it and
a failure shows the tail of the server log.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_dsv4_backend import run as R  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRATCH = Path(os.environ.get("DSV4_SCRATCH", ROOT / ".scratch"))


@dataclass
class TinyServer:
    """A running ``vllm serve`` of the tiny model."""

    base_url: str  # http://127.0.0.1:<port>
    model: str  # served model name
    log_path: Path
    marker_dir: Path
    pid: int
    launch_to_health_s: float
    attn_impl: str  # VLLM_DSV4_ATTN_IMPL of the server

    def post(self, path: str, payload: dict, timeout: float = 300.0) -> dict:
        """POST JSON to ``base_url + path``; raise with the body on HTTP errors."""
        req = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(
                f"POST {path} -> HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}"
            ) from e

    def complete(self, prompt: str, max_tokens: int, **extra: object) -> dict:
        """A greedy completion of exactly ``max_tokens`` tokens (``ignore_eos``);
        ``extra``: more request fields (``logprobs``...)."""
        return self.post("/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, **extra,
        })  # fmt: skip

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def markers(self) -> list[dict]:
        """The plugin's marker files (one per vLLM process that loaded it)."""
        return [json.loads(p.read_text()) for p in sorted(self.marker_dir.glob("*.json"))]


@pytest.fixture(scope="session")
def tiny_server():
    """Start the tiny server once per session; yield :class:`TinyServer`."""
    serve = R.load_serve_config(R.TINY_SERVE_CONFIG)
    run_dir = SCRATCH / "tests" / f"server-{os.getpid()}"
    marker_dir = run_dir / "markers"
    marker_dir.mkdir(parents=True, exist_ok=True)
    env = R.cpu_env(SCRATCH)
    env.update(
        # Per session, so concurrent sessions do not share IPC sockets.
        TMPDIR=str(run_dir / "tmp"),
        VLLM_DSV4_MARKER_DIR=str(marker_dir),
        # The plugin's layer (the product) unless the caller picks vLLM's own
        # (VLLM_DSV4_ATTN_IMPL=vllm runs these tests on vLLM's DeepSeek-V4 CPU layer).
        VLLM_DSV4_ATTN_IMPL=env.get("VLLM_DSV4_ATTN_IMPL", "plugin"),
        PYTHONUNBUFFERED="1",
        # The worker's live workspace summary (test_workspace_live_served.py).
        VLLM_DSV4_WORKSPACE_LOG_EVERY=env.get("VLLM_DSV4_WORKSPACE_LOG_EVERY", "4"),
    )
    (run_dir / "tmp").mkdir(parents=True, exist_ok=True)
    timeout = float(os.environ.get("DSV4_SERVER_TIMEOUT", "900"))
    server = R.make_server(serve, log_path=run_dir / "server.log", env=env, cwd=ROOT)
    try:
        server.start()
        try:
            server.wait_healthy(timeout=timeout)
        except R.RunError as e:
            pytest.fail(f"{e}\n(DSV4_SERVER_TIMEOUT={timeout:.0f} s)")
        assert server.proc is not None and server.healthy_after_s is not None
        yield TinyServer(
            base_url=server.base_url,
            model=serve.served_model_name,
            log_path=server.log_path,
            marker_dir=marker_dir,
            pid=server.proc.pid,
            launch_to_health_s=server.healthy_after_s,
            attn_impl=env["VLLM_DSV4_ATTN_IMPL"],
        )
    finally:
        server.stop(timeout=60)
