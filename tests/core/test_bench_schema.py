# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The layer benchmark's JSON schema and its zero-allocation claim (not timed).

Runs ``vllm_dsv4_backend.bench`` with a tiny config (2 layers: C4 with the indexer logits
path + C128, small contexts, 2 steps) and checks:

- every documented key is there, nothing else (``docs/benchmarks.md``), JSON round trip;
- ``allocs_per_step`` is 0 for ``shared`` / ``private`` and, for ``off``, exactly the number
  of workspace views the step leases, computed independently from the workspace sizing
  (so neither a silent 0 nor extra glue allocations pass);
- negative controls: an allocation injected into the glue shows up in ``allocs_per_step``;
  one injected into a kernel shows up in ``kernel_allocs_per_step`` only;
- the CLI (``--help``, ``--summary-from``) and ``scripts/gpu_check.sh --dry-run`` (CPU, tiny
  sizes, ``import vllm`` blocked as on the GPU box) end to end.

Latency figures are printed by the benchmark, never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_dsv4_backend import eager
from vllm_dsv4_backend.bench import cli
from vllm_dsv4_backend.bench import layer_bench as L
from vllm_dsv4_backend.bench import schema as S
from vllm_dsv4_backend.workspace import WorkspaceConfig

REPO = Path(__file__).resolve().parents[2]


def _tiny(**kw):
    base = dict(steps=2, warmup=1)
    base.update(kw)
    return L.tiny_config(**base)


@pytest.fixture(scope="module")
def tiny_result() -> dict:
    # One thread: OpenMP threads sharing busy cores collapse (see resolve_threads).
    return L.run(_tiny(), threads=1, argv=["test"])


def _expected_off_allocs(cfg: L.BenchConfig, run_indexer: bool) -> int:
    """Views a step leases, from the workspace sizing (independent of the bench code)."""
    wcfg = WorkspaceConfig(max_num_batched_tokens=1, num_local_heads=cfg.local_heads,
                           padded_q_heads=cfg.padded_heads, index_topk=cfg.index_topk,
                           indexer_kv_dtype=cfg.indexer_kv_dtype, include_attn_out=True)
    n = 0
    for r in cfg.layers:
        fams = ["q"]
        if r == 4:
            fams += (["indexer_q"] if run_indexer else []) + ["topk"]
        n += sum(len(wcfg.family_buffers(f)) for f in fams)
    return n


def test_schema_keys_and_json_round_trip(tiny_result: dict) -> None:
    S.validate_result(tiny_result)
    again = json.loads(json.dumps(tiny_result))
    S.validate_result(again)
    assert set(again) == set(S.RESULT_KEYS)
    cfg = _tiny()
    assert len(again["cases"]) == len(cfg.cases()) * len(cfg.policies)
    for c in again["cases"]:
        assert c["policy"] in ("off", "shared", "private")
        assert isinstance(c["allocs_per_step"], int)
        assert c["steps"] >= 2
        assert c["p50_ms"] > 0 and c["p99_ms"] >= c["p50_ms"] * 0.999
        assert c["floor_bytes"] > 0 and c["achieved_GBps"] > 0
    # The tiny config exercises the indexer logits path (context 256 -> 64 entries > 32).
    assert all(c["indexer"] for c in again["cases"])
    assert {c["mode"] for c in again["cases"]} == {"decode", "prefill"}
    # A schema change must fail validation.
    broken = json.loads(json.dumps(tiny_result))
    del broken["cases"][0]["allocs_per_step"]
    with pytest.raises(ValueError, match="allocs_per_step"):
        S.validate_result(broken)


def test_zero_allocations_with_workspace(tiny_result: dict) -> None:
    cfg = _tiny()
    off_expected = _expected_off_allocs(cfg, run_indexer=True)
    by_key: dict[tuple, dict[str, dict]] = {}
    for c in tiny_result["cases"]:
        by_key.setdefault((c["mode"], c["batch"], c["tokens"], c["context"]), {})[
            c["policy"]] = c
        if c["policy"] in ("shared", "private"):
            assert c["allocs_per_step"] == 0, c
            assert c["workspace_allocs_per_step"] == 0, c
            assert c["workspace_bytes"] > 0
        else:
            assert c["allocs_per_step"] == off_expected, c
            assert c["workspace_allocs_per_step"] == off_expected
            assert c["workspace_bytes"] == 0
    for key, pol in by_key.items():
        # Kernels do the same work whatever the policy; only the glue differs.
        kern = {p: c["kernel_allocs_per_step"] for p, c in pol.items()}
        assert len(set(kern.values())) == 1, (key, kern)
        assert pol["off"]["total_allocs_per_step"] - pol["shared"]["total_allocs_per_step"] \
            == off_expected
        assert pol["private"]["workspace_bytes"] > pol["shared"]["workspace_bytes"]
    for c in tiny_result["comparisons"]:
        assert c["baseline"] == "off" and c["allocs_per_step"] == 0
        assert c["baseline_allocs_per_step"] == off_expected


def test_mxfp4_indexer_and_swa_layer() -> None:
    cfg = _tiny(indexer_kv_dtype="mxfp4", layers=(0, 4), prefill_tokens=(), batches=(2,),
                peer=False)
    res = L.run(cfg, threads=1)
    S.validate_result(res)
    exp = _expected_off_allocs(cfg, run_indexer=True)
    assert exp == 2 + 2 + 3 + 3  # q/out twice, mxfp4 q/scales/weights, topk local/global/lens
    allocs = {c["policy"]: c["allocs_per_step"] for c in res["cases"]}
    assert allocs == {"off": exp, "shared": 0, "private": 0}
    assert res["peer"]["rows"] == [] and not res["peer"]["available"]


def test_negative_controls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counter must see glue allocations and attribute kernel ones to the kernels."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _negative_controls(monkeypatch)
    finally:
        torch.set_num_threads(old)


def _negative_controls(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _tiny(layers=(4, 128), batches=(1,), prefill_tokens=(), policies=("shared",),
                steps=1, peer=False)
    dev = torch.device("cpu")
    case = L.build_case(cfg, "decode", 1, 1, 256, dev, 0)
    mgr = L.make_manager(cfg, "shared", 1, dev)
    floor = L.floor_bytes(cfg, case)

    def once() -> dict:
        recs, _ = L.bench_case(cfg, case, {"shared": mgr}, floor, 1.0)
        return recs[0]

    clean = once()
    assert clean["allocs_per_step"] == 0

    real_lease = mgr.lease

    def leaky_lease(*a, **k):
        torch.empty(4)  # a glue allocation the workspace was meant to remove
        return real_lease(*a, **k)

    monkeypatch.setattr(mgr, "lease", leaky_lease)
    leaky = once()
    # q (C4), indexer_q, topk, q (C128): one stray tensor per lease call.
    assert leaky["allocs_per_step"] == leaky["leases_per_step"] == 4
    monkeypatch.setattr(mgr, "lease", real_lease)

    real_attend = eager.attend

    def attend_with_temp(*a, **k):
        torch.zeros(8)
        return real_attend(*a, **k)

    monkeypatch.setattr(eager, "attend", attend_with_temp)
    kern = once()
    assert kern["allocs_per_step"] == 0
    assert kern["kernel_allocs_per_step"] == clean["kernel_allocs_per_step"] + 2


def test_floor_bytes_formula() -> None:
    cfg = L.default_config(device="cpu", layers=(4, 128))
    case = L.build_case(cfg, "decode", 2, 2, 8192, torch.device("cpu"), 0)
    ie = 132  # fp8 indexer entry
    c4 = 2 * ((128 + 512) * 584 + (8192 // 4) * ie)
    c128 = 2 * (128 + 8192 // 128) * 584
    assert L.floor_bytes(cfg, case) == c4 + c128


def test_cli_help_and_summary(tiny_result: dict, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    assert "--json" in capsys.readouterr().out
    path = tmp_path / "r.json"
    path.write_text(json.dumps(tiny_result))
    assert cli.main(["--summary-from", str(path)]) == 0
    out = capsys.readouterr().out.rstrip().splitlines()
    assert "allocs/step in the eager region, shared" in "\n".join(out)
    assert out[-1].startswith(("attention", "latency"))  # the summary table comes last
    args = cli.build_parser().parse_args(["--num-layers", "3", "--context", "1k,8k",
                                          "--prefill", "--batch", "4"])
    cfg = cli.config_from_args(args)
    assert cfg.layers == (4, 128, 4) and cfg.contexts == (1024, 8192)
    assert cfg.prefill_tokens == (1024, 4096) and cfg.batches == (4,)


def test_gpu_check_dry_run(tmp_path: Path) -> None:
    """scripts/gpu_check.sh --dry-run: CPU, tiny sizes, vLLM blocked, summary table last."""
    (tmp_path / "test_trivial.py").write_text("def test_ok():\n    assert True\n")
    env = dict(os.environ)
    env.update(GPU_CHECK_TESTS=str(tmp_path / "test_trivial.py"), PYTHON=sys.executable,
               BENCH_ARGS="--preset tiny --device cpu --batch 1 --no-peer --steps 1")
    out = tmp_path / "out"
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--out",
                        str(out)], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "vllm is blocked" in p.stdout
    res = json.loads((out / "bench.json").read_text())
    S.validate_result(res)
    assert res["meta"]["vllm"] is None or isinstance(res["meta"]["vllm"], str)
    lines = p.stdout.rstrip().splitlines()
    i = max(k for k, line in enumerate(lines) if line.startswith("== gpu_check summary"))
    tail = "\n".join(lines[i:])
    assert "pytest   PASS" in tail and "bench    PASS" in tail
    assert "allocs/step in the eager region, off" in tail


def test_e2e_orchestration_with_fake_servers(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """--e2e without vLLM: both servers up, alternating rounds, paired ratios, policy check."""
    pytest.importorskip("yaml")
    from vllm_dsv4_backend import run as R
    from vllm_dsv4_backend.bench import e2e as E

    order: list[str] = []
    ttft = {("shared", 0): 10.0, ("off", 0): 20.0, ("shared", 1): 30.0, ("off", 1): 20.0,
            ("shared", 2): 12.0, ("off", 2): 10.0}
    wrong_policy: dict[str, str] = {}

    class FakeServer:
        def __init__(self, policy: str, env: dict, log_path: Path) -> None:
            self.policy, self.env, self.log_path = policy, env, log_path
            self.base_url = f"http://fake-{policy}"
            self.stopped = False

        def start(self) -> FakeServer:
            d = Path(self.env["VLLM_DSV4_MARKER_DIR"])
            d.mkdir(parents=True, exist_ok=True)
            seen = wrong_policy.get(self.policy, self.env["VLLM_DSV4_WORKSPACE"])
            (d / "layer-c4-1.json").write_text(json.dumps({"workspace_policy": seen}))
            return self

        def wait_healthy(self, timeout: float, progress=None) -> float:
            return 1.5

        def stop(self) -> int:
            self.stopped = True
            return 0

    servers: list[FakeServer] = []

    def make_server(serve, *, log_path, env, **kw):
        s = FakeServer(env["VLLM_DSV4_WORKSPACE"], env, log_path)
        servers.append(s)
        return s

    def run_logged(cmd, log_path, env, what):
        policy = cmd[cmd.index("--base-url") + 1].rsplit("-", 1)[1]
        rnd = sum(1 for p in order if p == policy)
        order.append(policy)
        out = Path(cmd[cmd.index("--result-dir") + 1]) / cmd[cmd.index("--result-filename") + 1]
        v = ttft[(policy, rnd)]
        out.write_text(json.dumps({"mean_ttft_ms": v, "mean_tpot_ms": v / 10, "completed": 4,
                                   "failed": 0}))

    monkeypatch.setattr(R, "make_server", make_server)
    monkeypatch.setattr(R, "run_logged", run_logged)
    res = E.run_e2e(rounds=3, out_dir=tmp_path)
    assert order == ["shared", "off", "off", "shared", "shared", "off"]
    assert all(s.stopped for s in servers) and len(servers) == 2
    assert set(res) == set(E.E2E_KEYS) and res["policy_confirmed"]
    # paired ratios 0.5, 1.5, 1.2 -> median 1.2 (a ratio of medians would give 12/20 = 0.6)
    assert res["ratios"]["mean_ttft_ms"] == pytest.approx(1.2)
    assert res["by_policy"]["shared"]["mean_ttft_ms"] == 12.0
    assert res["ratios"]["median_ttft_ms"] is None
    assert "shared/off" in E.format_e2e(res)

    wrong_policy["off"] = "shared"  # the env var did not take effect in that server
    order.clear()
    res = E.run_e2e(rounds=1, out_dir=tmp_path / "again")
    assert not res["policy_confirmed"]
