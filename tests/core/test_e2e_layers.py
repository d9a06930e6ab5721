# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""bench.e2e_layers without vLLM: rounds alternate the layers' order, warm-up rounds are
left out, every round draws new prompts that both layers get, ratios are the median of
per-round pairs with the 95% CI of the median and their Hodges-Lehmann estimate with its
signed-rank CI (checked against the published critical values and brute force), and the
streaming client's TTFT/TPOT arithmetic and errors, against a local aiohttp server (the
real vLLM server is in tests/vllm/test_bench_client_served.py)."""

import asyncio
import json
import math
import os
from pathlib import Path

import pytest

from vllm_dsv4_backend.bench.ab import hodges_lehmann_ci, median_ci


def _fake_servers(tmp_path: Path, monkeypatch, R, E):
    servers = []

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

    monkeypatch.setattr(R, "make_server", make_server)
    return servers


def test_alternating_rounds_warmup_and_paired_ratios(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("yaml")
    pytest.importorskip("tokenizers")
    from vllm_dsv4_backend import run as R
    from vllm_dsv4_backend.bench import e2e_layers as E

    servers = _fake_servers(tmp_path, monkeypatch, R, E)
    calls: list[tuple[str, list[list[int]]]] = []
    # TTFT per recorded round: plugin 10, 30, 10, 10; vLLM 20 throughout -> pairs
    # 2, 2/3, 2, 2. Warm-up rounds return a huge TTFT that must not show.
    plugin_ttft = [10.0, 30.0, 10.0, 10.0]

    wakes: list[str] = []

    def measure_block(url, model, prompts, tokens, sid):
        impl = url.rsplit("-", 1)[1]
        if tokens == 1:  # the unrecorded wake-up request before every block
            assert len(prompts) == 1 and len(prompts[0]) == 1
            wakes.append(impl)
            return {}
        calls.append((impl, prompts))
        n = sum(1 for c in calls if c[0] == impl) - 1 - 2  # this round, after 2 warm-ups
        ttft = 1e6 if n < 0 else plugin_ttft[n] if impl == "plugin" else 20.0
        return {"mean_ttft_ms": ttft, "mean_tpot_ms": 1.0, "output_throughput": 100.0,
                "cpu_ms_per_token": {"plugin": 10.0, "vllm": 20.0}[impl],
                "output_tokens": 3 * len(prompts), "wall_s": 0.1}

    monkeypatch.setattr(E, "measure_block", measure_block)
    sc = E.Scenario(concurrency=3, prompt_len=5, output_len=3)
    res = E.run(rounds=4, warmup=2, scenarios={"t": sc}, out_dir=tmp_path, settle_s=0.0,
                progress=None)
    order = [c[0] for c in calls]
    assert wakes == order  # each block right after a wake-up of its own server
    # rounds -2..3: even rounds plugin first, odd rounds vLLM first
    assert order == ["plugin", "vllm", "vllm", "plugin"] * 3
    assert all(s.stopped for s in servers) and len(servers) == 2
    prompts = [c[1] for c in calls]
    for a, b in zip(prompts[::2], prompts[1::2]):
        assert a == b  # both layers get the round's prompts
    assert len({json.dumps(p) for p in prompts}) == 6  # a new block every round
    assert all(len(p) == 3 and all(len(x) == 5 for x in p) for p in prompts)
    ttft = res["summary"]["t"]["mean_ttft_ms"]
    assert ttft["pairs"] == 4 and ttft["ratio_median"] == pytest.approx(2.0)
    assert ttft["ratio_min"] == pytest.approx(2 / 3) and ttft["ratio_max"] == pytest.approx(2.0)
    assert (ttft["ratio_ci95_lo"], ttft["ratio_ci95_hi"]) == pytest.approx((2 / 3, 2.0))
    assert ttft["plugin"] == pytest.approx(10.0) and ttft["verdict"] == "tie"
    # HL of logs [ln 2, -ln 1.5, ln 2, ln 2]: 6 of the 10 Walsh averages are ln 2; n = 4
    # is below the 95% reach, so its interval is the extremes.
    assert ttft["hl_ratio"] == pytest.approx(2.0) and ttft["hl_verdict"] == "tie"
    assert (ttft["hl_ci95_lo"], ttft["hl_ci95_hi"]) == pytest.approx((2 / 3, 2.0))
    cpu_row = res["summary"]["t"]["cpu_ms_per_token"]
    assert cpu_row["ratio_median"] == 2.0 and cpu_row["verdict"] == "plugin"
    assert cpu_row["hl_ratio"] == pytest.approx(2.0) and cpu_row["hl_verdict"] == "plugin"
    assert res["schema"] == "vllm-dsv4-e2e-layers/3"
    text = E.format_result(res)
    assert "cpu_ms_per_token" in text and "plugin" in text.splitlines()[-1]
    assert json.loads((tmp_path / "runs.json").read_text())[0]["round"] == -2


def test_median_ci_and_verdict() -> None:
    from vllm_dsv4_backend.bench.ab import verdict

    xs = [float(i) for i in range(1, 101)]
    # n=100: order statistics 40 and 61 (1-based), the textbook 95% interval
    assert median_ci(xs) == (40.0, 61.0)
    assert median_ci([3.0]) == (3.0, 3.0)
    # [x_(j), x_(k)] holds the median with probability P(j <= Bin(n, 1/2) < k), exactly;
    # at least 95% for every n (it is min..max below n = 6, where 95% is unreachable).
    for n in range(1, 400):
        lo, hi = median_ci([float(i) for i in range(1, n + 1)])
        j, k = int(lo), int(hi)
        cover = sum(math.comb(n, i) for i in range(j, k)) / 2**n
        assert cover >= 0.95 or (j, k) == (1, n), (n, j, k, cover)
    assert verdict(1.01, 1.2) == "plugin" and verdict(0.8, 0.99) == "vllm"
    assert verdict(0.99, 1.01) == "tie" and verdict(1.0, 1.1) == "tie"
    assert verdict(None, None) == "n/a"


def _walsh_logs(xs):
    ys = [math.log(x) for x in xs]
    return sorted((ys[i] + ys[j]) / 2 for i in range(len(ys)) for j in range(i, len(ys)))


def test_hodges_lehmann_ci_against_published_ranks_and_brute_force() -> None:
    import itertools
    import random
    import statistics

    from vllm_dsv4_backend.bench.ab import _signed_rank_cut, _signed_rank_cut_normal

    # Two-sided 5% critical values of the signed-rank statistic T (reject if T <= c), from
    # the published tables: the lower bound is the (c+1)-th smallest Walsh average.
    assert [_signed_rank_cut(n) for n in (6, 8, 10, 15, 20, 25, 30, 50)] == [
        0, 3, 8, 25, 52, 89, 137, 434]
    assert [_signed_rank_cut(n) for n in (1, 2, 5)] == [0, 0, 0]  # 95% unreachable
    # The exact null of T+ by enumerating every sign pattern (an oracle independent of
    # the subset-sum table): the cut keeps P(T+ <= k) <= 2.5% and is the largest that does.
    for n in range(6, 15):
        sums = [sum(r for r, s in zip(range(1, n + 1), signs) if s)
                for signs in itertools.product((0, 1), repeat=n)]
        k = _signed_rank_cut(n)
        assert sum(t <= k for t in sums) / 2**n <= 0.025 < sum(t <= k + 1 for t in sums) / 2**n
    # Normal approximation beyond the exact range: close to the exact cut at the seam.
    assert abs(_signed_rank_cut_normal(150) - _signed_rank_cut(150)) <= 2
    assert _signed_rank_cut(151) == _signed_rank_cut_normal(151)

    # The estimate: exp of the median of the log Walsh averages.
    est, lo, hi = hodges_lehmann_ci([1.0, math.e, math.e**2])
    assert (est, lo, hi) == pytest.approx((math.e, 1.0, math.e**2))
    rng = random.Random(7)
    for n in (7, 12, 31, 60):
        xs = [math.exp(rng.gauss(0.05, 0.2)) for _ in range(n)]
        w = _walsh_logs(xs)
        k = _signed_rank_cut(n)
        est, lo, hi = hodges_lehmann_ci(xs)
        assert est == pytest.approx(math.exp(statistics.median(w)))
        assert (lo, hi) == pytest.approx((math.exp(w[k]), math.exp(w[len(w) - 1 - k])))
        # A ratio and its inverse: the same interval, mirrored.
        inv = hodges_lehmann_ci([1 / x for x in xs])
        assert inv == pytest.approx((1 / est, 1 / hi, 1 / lo))
        # One absurd pair moves the estimate by at most one rank, not by its size.
        bad = hodges_lehmann_ci(xs[:-1] + [1e6])
        assert bad[0] < math.exp(max(w)) and bad[1] >= lo * 0.9
    # Coverage: symmetric noise about a true ratio of 1.05, n = 30.
    hits = 0
    for _ in range(300):
        xs = [1.05 * math.exp(rng.uniform(-0.3, 0.3)) for _ in range(30)]
        _, lo, hi = hodges_lehmann_ci(xs)
        hits += lo <= 1.05 <= hi
    assert 0.91 <= hits / 300 <= 0.99, hits
    for bad_input in ([], [0.0], [-1.0, 2.0], [math.inf], [math.nan], [1.0, None]):
        with pytest.raises(ValueError, match="ratios"):
            hodges_lehmann_ci(bad_input)


def _sse_app(chunks, status=200):
    from aiohttp import web

    async def handler(request):
        body = await request.json()
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        if status != 200:
            return web.Response(status=status, text="boom")
        resp = web.StreamResponse()
        await resp.prepare(request)
        for delay, payload in chunks:
            await asyncio.sleep(delay)
            await resp.write(b"data: " + payload + b"\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    return app


def _stream(chunks, status=200):
    from aiohttp import web

    from vllm_dsv4_backend.bench.e2e_layers import stream_completion

    async def main():
        import aiohttp

        runner = web.AppRunner(_sse_app(chunks, status))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as s:
                return await stream_completion(s, f"http://127.0.0.1:{port}", "m", [1, 2], 3)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def _tok(text: str) -> bytes:
    return json.dumps({"choices": [{"text": text}], "usage": None}).encode()


def test_stream_completion_ttft_tpot() -> None:
    pytest.importorskip("aiohttp")
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 3}}).encode()
    r = _stream([(0.20, _tok("a")), (0.10, _tok("b")), (0.10, _tok("c")), (0, usage),
                 (0, b"[DONE]")])
    assert r["tokens"] == 3
    # The first token is 0.2 s after the request by construction, so TTFT counts from
    # the request; no upper bound: a loaded machine adds any delay.
    assert math.isfinite(r["ttft_s"]) and r["ttft_s"] > 0
    # (last - first) / (tokens - 1): finite and positive (its size is the machine's).
    assert math.isfinite(r["tpot_s"]) and r["tpot_s"] > 0


def test_stream_completion_errors() -> None:
    pytest.importorskip("aiohttp")
    from vllm_dsv4_backend.bench.ab import E2EError

    with pytest.raises(E2EError, match="HTTP 500: boom"):
        _stream([], status=500)
    with pytest.raises(E2EError, match="without a generated token"):
        _stream([(0, b"[DONE]")])


def test_session_cpu_counts_this_session() -> None:
    from vllm_dsv4_backend.bench.e2e_layers import session_cpu_s

    assert session_cpu_s(os.getsid(0)) > 0
    assert session_cpu_s(-12345) == 0
