# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker's live workspace summary while ``vllm serve`` serves the tiny
model (the session's ``tiny_server``, started with
``VLLM_DSV4_WORKSPACE_LOG_EVERY=4``): after a few requests the server log
holds the line, logged by the worker, with leases > 0 per model step and no
allocation in a leased family (the default ``shared`` policy). And once more
at shutdown, from a server stopped gracefully (``--shutdown-timeout``: with
vLLM's default of 0 the API server SIGKILLs the worker, where no exit handler
runs)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_dsv4_backend import run as R  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRATCH = Path(os.environ.get("DSV4_SCRATCH", ROOT / ".scratch"))

LINE = re.compile(
    r"workspace live \(CPU\): (?P<steps>\d+) model steps, leases (?P<lps>[\d.]+)/step "
    r"\((?P<leases>\d+) total, max (?P<max>\d+)\), allocations in leased families "
    r"(?P<aps>[\d.]+)/step \((?P<allocs>\d+) total\), fence waits [\d.]+/step \(\d+ total\), "
    r"reserved (?P<reserved>[\d.]+) MiB, peak leased [\d.]+ MiB, policy (?P<policy>\w+), "
    r"fallbacks to the layer's own allocation [\d.]+/step \((?P<fallbacks>\d+) total\)"
)


@pytest.mark.vllm
@pytest.mark.slow
def test_worker_logs_live_workspace_counters(tiny_server):
    if tiny_server.attn_impl != "plugin":
        pytest.skip("vLLM's own layer has no workspace")
    for prompt in ("The quick brown fox", "DeepSeek-V4 attention leases"):
        tiny_server.complete(prompt, 12)
    deadline = time.monotonic() + 30
    while True:
        found = [(ln, m) for ln in tiny_server.log_text().splitlines()
                 if (m := LINE.search(ln))]
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert found, "no live workspace summary in the server log"
    line, m = found[-1]
    assert "Worker" in line, line  # logged by the worker process, through vLLM's handlers
    assert int(m["steps"]) >= 4 and int(m["steps"]) % 4 == 0, line
    assert int(m["leases"]) > 0 and float(m["lps"]) > 0, line
    assert int(m["allocs"]) == 0 and float(m["aps"]) == 0.0, line
    assert int(m["fallbacks"]) == 0, line  # the CPU layer never bypasses the workspace
    assert m["policy"] == "shared" and float(m["reserved"]) > 0, line


@pytest.mark.vllm
@pytest.mark.slow
def test_worker_logs_the_summary_at_shutdown():
    run_dir = SCRATCH / "tests" / f"live-{os.getpid()}"
    (run_dir / "tmp").mkdir(parents=True, exist_ok=True)
    env = R.cpu_env(SCRATCH)
    env.update(TMPDIR=str(run_dir / "tmp"), VLLM_DSV4_ATTN_IMPL="plugin",
               VLLM_DSV4_WORKSPACE_LOG_EVERY="100000", PYTHONUNBUFFERED="1")
    server = R.make_server(R.TINY_SERVE_CONFIG, log_path=run_dir / "server.log", env=env,
                           # Generous: on a loaded CI box the engine core had not acted on
                           # SIGTERM 10 s later, and vLLM then SIGKILLs it and the worker.
                           cwd=ROOT, extra_args=["--shutdown-timeout", "120"])
    try:
        server.start()
        server.wait_healthy(timeout=float(os.environ.get("DSV4_SERVER_TIMEOUT", "900")))
        body = json.dumps({"model": "tiny-dsv4", "prompt": "hello there", "max_tokens": 6,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(server.base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.status == 200
        # SIGTERM to the API server alone (as a supervisor stops it), then wait
        # for the worker to finish: ServerProcess.stop SIGKILLs the whole
        # group once the API server is gone, which would cut the worker short.
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=300)
        deadline = time.monotonic() + 30
        while True:
            log = server.log_path.read_text(errors="replace")
            found = [(ln, m) for ln in log.splitlines() if "(at shutdown)" in ln
                     and (m := LINE.search(ln))]
            if found or "workers exited gracefully" in log or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        server.stop(timeout=60)
    assert len(found) == 1, log[-4000:]
    line, m = found[0]
    assert "Worker" in line and int(m["steps"]) >= 6 and int(m["leases"]) > 0, line
    assert int(m["allocs"]) == 0, line
