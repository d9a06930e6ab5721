# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared fixtures for tests against a real vLLM (CPU build) with this plugin.

``tiny_server`` (session scope) starts one ``vllm serve`` of
``configs/tiny-dsv4`` on a free loopback port, exactly as
``scripts/serve_tiny.sh`` does (``FLASHMLA_SPARSE_DSV4``, fp8 KV cache, seeded
dummy weights, eager), waits for ``/health`` and stops it at the end of the
session. Logs and the plugin's per-process marker files go to
``.scratch/tests/server-<pid>/``. Startup on a 2-core CPU takes minutes (it is
mostly imports); ``DSV4_SERVER_TIMEOUT`` (seconds, default 900) bounds it and
a failure shows the tail of the server log.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from _helpers import healthy  # noqa: E402  (tests/vllm is on sys.path)

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "configs" / "tiny-dsv4"
SERVED_NAME = "tiny-dsv4"
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

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def markers(self) -> list[dict]:
        """The plugin's marker files (one per vLLM process that loaded it)."""
        return [json.loads(p.read_text()) for p in sorted(self.marker_dir.glob("*.json"))]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 80) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"<no log: {e}>"


def _vllm_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("vllm")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def server_command(port: int) -> list[str]:
    """The ``vllm serve`` command line of ``scripts/serve_tiny.sh``."""
    return [
        *_vllm_cmd(), "serve", str(MODEL_DIR),
        "--attention-backend", "FLASHMLA_SPARSE_DSV4",
        "--kv-cache-dtype", "fp8",
        "--load-format", "dummy",
        "--tokenizer-mode", "hf",
        "--max-model-len", "4096",
        "--enforce-eager",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", SERVED_NAME,
        "--generation-config", "vllm",
    ]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_server():
    """Start ``vllm serve configs/tiny-dsv4`` once per session; yield :class:`TinyServer`."""
    run_dir = SCRATCH / "tests" / f"server-{os.getpid()}"
    marker_dir = run_dir / "markers"
    (run_dir / "tmp").mkdir(parents=True, exist_ok=True)
    (SCRATCH / "cache" / "vllm").mkdir(parents=True, exist_ok=True)
    marker_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "server.log"
    port = _free_port()
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        TMPDIR=str(run_dir / "tmp"),
        VLLM_CACHE_ROOT=str(SCRATCH / "cache" / "vllm"),
        VLLM_DSV4_MARKER_DIR=str(marker_dir),
        # The plugin's layer (the product) unless the caller picks vLLM's own
        # (VLLM_DSV4_ATTN_IMPL=vllm runs these tests on vLLM's DeepSeek-V4 CPU layer).
        VLLM_DSV4_ATTN_IMPL=env.get("VLLM_DSV4_ATTN_IMPL", "plugin"),
        PYTHONUNBUFFERED="1",
    )
    timeout = float(os.environ.get("DSV4_SERVER_TIMEOUT", "900"))
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            server_command(port), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"vllm serve exited with code {proc.returncode} before /health "
                    f"answered; log {log_path}:\n{_tail(log_path)}"
                )
            if healthy(base_url, timeout=5):
                break
            if time.monotonic() - t0 > timeout:
                pytest.fail(
                    f"vllm serve did not answer /health within {timeout:.0f} s "
                    f"(DSV4_SERVER_TIMEOUT); log {log_path}:\n{_tail(log_path)}"
                )
            time.sleep(2)
        yield TinyServer(
            base_url=base_url,
            model=SERVED_NAME,
            log_path=log_path,
            marker_dir=marker_dir,
            pid=proc.pid,
            launch_to_health_s=time.monotonic() - t0,
            attn_impl=env["VLLM_DSV4_ATTN_IMPL"],
        )
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (we started it as a session leader)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
