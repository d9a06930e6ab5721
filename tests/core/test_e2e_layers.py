# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""bench.e2e_layers without vLLM: both layers' servers up at once, rounds alternate,
ratios are the median of per-round pairs, CPU time per token from the server's session."""

import json
from pathlib import Path

import pytest


def test_alternating_rounds_and_paired_ratios(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("yaml")
    from vllm_dsv4_backend import run as R
    from vllm_dsv4_backend.bench import e2e_layers as E

    order: list[str] = []
    servers = []
    cpu = {"plugin": 0.0, "vllm": 0.0}

    class FakeProc:
        def __init__(self, pid: int) -> None:
            self.pid = pid

    class FakeServer:
        def __init__(self, impl: str) -> None:
            self.impl = impl
            self.base_url = f"http://fake-{impl}"
            self.proc = FakeProc(100 if impl == "plugin" else 200)
            self.log_path = tmp_path / f"{impl}.log"
            self.stopped = False

        def start(self):
            return self

        def wait_healthy(self, timeout, progress=None):
            return 1.0

        def stop(self):
            self.stopped = True

    def make_server(serve, *, log_path, env, **kw):
        s = FakeServer(env["VLLM_DSV4_ATTN_IMPL"])
        servers.append(s)
        return s

    def run_logged(cmd, log_path, env, what):
        impl = cmd[cmd.index("--base-url") + 1].rsplit("-", 1)[1]
        rnd = sum(1 for p in order if p == impl)
        order.append(impl)
        # plugin: TTFT 10 in round 0, 30 in round 1; vLLM 20 both: pairs 2.0, 0.667.
        ttft = {"plugin": (10.0, 30.0), "vllm": (20.0, 20.0)}[impl][rnd]
        cpu[impl] += {"plugin": 1.0, "vllm": 2.0}[impl]
        out = Path(cmd[cmd.index("--result-dir") + 1]) / cmd[cmd.index("--result-filename") + 1]
        out.write_text(json.dumps({"mean_ttft_ms": ttft, "mean_tpot_ms": 1.0,
                                   "output_throughput": 100.0, "total_output_tokens": 100,
                                   "completed": 4, "failed": 0}))

    monkeypatch.setattr(R, "make_server", make_server)
    monkeypatch.setattr(R, "run_logged", run_logged)
    monkeypatch.setattr(E, "session_cpu_s", lambda sid: cpu["plugin" if sid == 100 else "vllm"])
    res = E.run(rounds=2, scenarios={"c1": ["max-concurrency=1"]}, out_dir=tmp_path,
                progress=None)
    assert order == ["plugin", "vllm", "vllm", "plugin"]
    assert all(s.stopped for s in servers) and len(servers) == 2
    ttft = res["summary"]["c1"]["mean_ttft_ms"]
    assert ttft["ratio_median"] == pytest.approx((2.0 + 2 / 3) / 2)
    assert ttft["ratio_min"] == pytest.approx(2 / 3) and ttft["ratio_max"] == pytest.approx(2.0)
    # 1 s vs 2 s of server CPU for 100 tokens: 10 vs 20 ms per token, ratio 2.
    cpu_row = res["summary"]["c1"]["cpu_ms_per_token"]
    assert cpu_row["plugin"] == pytest.approx(10.0) and cpu_row["ratio_median"] == 2.0
    assert "cpu_ms_per_token" in E.format_result(res)


def test_session_cpu_counts_this_session() -> None:
    import os

    from vllm_dsv4_backend.bench.e2e_layers import session_cpu_s

    assert session_cpu_s(os.getsid(0)) > 0
    assert session_cpu_s(-12345) == 0
