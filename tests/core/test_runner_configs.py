# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The user-facing configs and ``vllm-dsv4-run`` pieces that need no server.

- every serve config says what the issue asks (TP4, EP, FLASHMLA_SPARSE_DSV4, ...);
  that vLLM's own parsers accept them is tests/vllm/test_runner_vllm.py (this
  module is torch-only: it never imports vLLM);
- lm_eval commands parse with lm_eval's parser (when installed);
- the gsm8k gate's numbers (baseline, binomial stderr, threshold) and the gate
  and bench-comparison math, including the edges (exact threshold, missing
  metrics, two-sided, zero baselines);
- the shipped smoke-task data is self-consistent (answers recomputed);
- the server lifecycle (health wait, crash with log tail, timeout, stop of
  the whole process group) against a stand-in HTTP server, no vLLM.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vllm_dsv4_backend import run as R
from vllm_dsv4_backend.run.config import _get

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
SERVE_CONFIGS = sorted((CONFIGS / "serve").glob("*.yaml"))
BENCH_CONFIGS = sorted((CONFIGS / "bench").glob("*.yaml"))
EVAL_CONFIGS = sorted((CONFIGS / "lm_eval").glob("*.yaml"))
FP4 = CONFIGS / "serve" / "deepseek-v4-flash-tp4-fp4idx.yaml"
FP8 = CONFIGS / "serve" / "deepseek-v4-flash-tp4-fp8idx.yaml"
TINY = CONFIGS / "serve" / "tiny-dsv4-cpu.yaml"
GSM8K = CONFIGS / "lm_eval" / "gsm8k-gate.yaml"
SMOKE = CONFIGS / "lm_eval" / "tiny-smoke.yaml"


def test_expected_config_files_exist() -> None:
    names = {p.name for p in SERVE_CONFIGS}
    assert {FP4.name, FP8.name, TINY.name} <= names
    assert {"decode-heavy.yaml", "throughput.yaml"} <= {p.name for p in BENCH_CONFIGS}
    assert {GSM8K.name, SMOKE.name} <= {p.name for p in EVAL_CONFIGS}


# ---------------------------------------------------------------- serve configs


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.stem)
def test_serve_config_loads(path: Path) -> None:
    cfg = R.load_serve_config(path)
    assert cfg.model and cfg.served_model_name
    # Keys must be vLLM flag names, dash form, never the runner's host/port.
    for key in cfg.raw:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", key), key
    assert _get(cfg.raw, "attention-backend") == "FLASHMLA_SPARSE_DSV4"
    assert _get(cfg.raw, "kv-cache-dtype") == "fp8"


@pytest.mark.parametrize("path", [FP4, FP8], ids=lambda p: p.stem)
def test_production_serve_config_content(path: Path) -> None:
    cfg = R.load_serve_config(path)
    raw = cfg.raw
    assert raw["model"] == "deepseek-ai/DeepSeek-V4-Flash"
    assert raw["tensor-parallel-size"] == 4
    assert raw["enable-expert-parallel"] is True
    assert raw["tokenizer-mode"] == "deepseek_v4"
    assert raw["all2all-backend"] == "allgather_reducescatter"
    ac = json.loads(raw["attention-config"])
    if path == FP4:
        assert ac == {"use_fp4_indexer_cache": True}
    else:
        assert ac == {"indexer_kv_dtype": "fp8"}
    # An HF id is not a local path: passed to vLLM untouched.
    assert cfg.model_path is None and cfg.tokenizer == raw["model"]


def test_tiny_serve_config_resolves_model_from_anywhere(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # not the repo root: "configs/tiny-dsv4" must still resolve
    cfg = R.load_serve_config(TINY)
    assert cfg.raw["load-format"] == "dummy" and cfg.raw["tokenizer-mode"] == "hf"
    assert cfg.raw["enforce-eager"] is True
    assert cfg.served_model_name == "tiny-dsv4"
    want = (ROOT / "configs" / "tiny-dsv4").resolve()
    if want.is_dir():
        assert cfg.model_path == want and cfg.tokenizer == str(want)
        cmd = R.build_serve_command(cfg, host="127.0.0.1", port=8123, extra_args=["--x"])
        # positional model first: vLLM gives it precedence over the config's relative path
        assert cmd[3:5] == ["serve", str(want)]
        assert cmd[5:] == ["--config", str(TINY), "--host", "127.0.0.1", "--port", "8123", "--x"]


def test_yaml_to_flags_rules_and_errors() -> None:
    assert R.yaml_to_flags({"a": True, "b": False, "c": [1, "x"], "d": {"k": 1}, "e": 0.5}) == [
        "--a", "--c", "1", "x", "--d", '{"k": 1}', "--e", "0.5",
    ]  # fmt: skip
    with pytest.raises(R.ConfigError, match="'n'.*null"):
        R.yaml_to_flags({"n": None})
    with pytest.raises(R.ConfigError, match="plain string"):
        R.yaml_to_flags({"--n": 1})


def test_serve_config_errors(tmp_path: Path) -> None:
    bad = tmp_path / "x.yaml"
    for text, match in (("model: m\nport: 8000\n", "'port' is set by vllm-dsv4-run"),
                        ("tensor-parallel-size: 4\n", "'model'"),
                        ("- a\n- b\n", "mapping"),
                        ("model: [unclosed\n", "not valid YAML")):
        bad.write_text(text)
        with pytest.raises(R.ConfigError, match=match):
            R.load_serve_config(bad)
    with pytest.raises(R.ConfigError, match="does not exist"):
        R.load_serve_config(tmp_path / "missing.yaml")


# ---------------------------------------------------------------- bench configs


def test_bench_overrides_and_reserved(tmp_path: Path) -> None:
    bench = R.load_bench_config(CONFIGS / "bench" / "decode-heavy.yaml")
    cmd = R.build_bench_command(
        bench, base_url="http://h:1", model_name="m", tokenizer="t", tokenizer_mode=None,
        result_dir=tmp_path, result_filename="r.json",
        overrides=["num_prompts=2", "--random-output-len=16", "ignore-eos=false"],
    )  # fmt: skip
    s = shlex.join(cmd)
    assert "--num-prompts 2" in s and "--random-output-len 16" in s
    assert "--ignore-eos" not in cmd and "--tokenizer-mode" not in cmd
    with pytest.raises(R.ConfigError, match="set by vllm-dsv4-run"):
        R.apply_overrides(bench.args, ["base-url=http://x"])
    with pytest.raises(R.ConfigError, match="key=value"):
        R.apply_overrides(bench.args, ["num-prompts"])
    bad = tmp_path / "b.yaml"
    bad.write_text("kind: vllm_bench_serve\nargs:\n  model: x\n  num-prompts: 1\n")
    with pytest.raises(R.ConfigError, match=r"\['model'\] are set by vllm-dsv4-run"):
        R.load_bench_config(bad)
    bad.write_text("kind: lm_eval\nargs: {num-prompts: 1}\n")
    with pytest.raises(R.ConfigError, match="kind: vllm_bench_serve"):
        R.load_bench_config(bad)


# ---------------------------------------------------------------- eval configs


def test_gsm8k_gate_numbers() -> None:
    ev = R.load_eval_config(GSM8K)
    assert ev.tasks == ("gsm8k",) and ev.num_fewshot == 5
    assert {g.filter for g in ev.gates} == {"flexible-extract", "strict-match"}
    p, n = 0.951, 1319
    for g in ev.gates:
        assert g.metric == "exact_match" and g.baseline == p
        assert g.stderr == pytest.approx(math.sqrt(p * (1 - p) / n), abs=5e-5)
        assert g.abs_tol is None and g.k_stderr == 2.0 and not g.two_sided
        # The documented threshold: 0.951 - 2 * 0.0059 = 0.939
        just_in = {"gsm8k": {g.key: 0.9392, g.stderr_key: 0.006}}
        just_out = {"gsm8k": {g.key: 0.9385, g.stderr_key: 0.006}}
        r = R.evaluate_gate(g, just_in)
        assert r.passed and r.lower == pytest.approx(0.9392, abs=1e-9)
        assert R.evaluate_gate(g, just_out).passed is False
        assert R.evaluate_gate(g, {"gsm8k": {g.key: 0.99}}).passed  # one-sided


def test_smoke_eval_config_and_tasks() -> None:
    ev = R.load_eval_config(SMOKE)
    assert ev.include_path == (CONFIGS / "lm_eval" / "tasks").resolve()
    for task in ev.tasks:
        assert (ev.include_path / f"{task}.yaml").is_file()
    assert all(g.abs_tol == 0 and g.two_sided for g in ev.gates)
    assert {(g.task, g.key) for g in ev.gates} == {
        ("dsv4_smoke_arith", "exact_match,strict-match"),
        ("dsv4_smoke_arith", "exact_match,flexible-extract"),
        ("dsv4_smoke_choice", "acc,none"),
        ("dsv4_smoke_choice", "acc_norm,none"),
    }


def _smoke_utils():
    sys.path.insert(0, str(CONFIGS / "lm_eval" / "tasks"))
    try:
        import dsv4_smoke_utils
    finally:
        sys.path.pop(0)
    return dsv4_smoke_utils


def test_smoke_task_data_is_consistent() -> None:
    """Every arithmetic answer is recomputed from its worked line; choice labels are in range."""
    u = _smoke_utils()
    arith = u.read_jsonl(u.DATA_DIR / "arith_test.jsonl")
    fewshot = u.read_jsonl(u.DATA_DIR / "arith_fewshot.jsonl")
    assert len(arith) == 16 and len(fewshot) >= 2
    for row in arith + fewshot:
        work, final = row["answer"].rsplit("\n#### ", 1)
        a, op, b, c = re.search(r"(\d+) ([-+*/]) (\d+) = (\d+)", work).groups()
        val = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}.get(op)
        if op == "/":
            assert int(a) % int(b) == 0
            val = int(a) // int(b)
        assert val == int(c) == int(final), row
        assert re.search(r"#### (\-?[0-9\.\,]+)", row["answer"])  # strict-match finds it
    choice = u.read_jsonl(u.DATA_DIR / "choice_test.jsonl")
    assert len(choice) == 16
    for row in choice:
        assert len(row["choices"]) == 4 and 0 <= row["label"] < 4
        assert len(set(row["choices"])) == 4
    with pytest.raises(ValueError, match="dataset_kwargs.name"):
        u.load_smoke_dataset("nope")


def test_smoke_tasks_fit_vllm_stop_limit() -> None:
    """lm_eval appends the tokenizer's EOS string to `until`, and vLLM rejects more
    than VLLM_MAX_STOP_STRINGS (4) stop strings with HTTP 400: keep <= 3."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    for path in (CONFIGS / "lm_eval" / "tasks").glob("*.yaml"):
        task = yaml.load(path.read_text(), Loader=Loader)
        until = (task.get("generation_kwargs") or {}).get("until", [])
        assert len(until) <= 3, f"{path.name}: {len(until)} stop strings + EOS > 4"
        # The repository's own loaders: the smoke tasks' and the trained model's.
        module, _, func = task["custom_dataset"].partition(".")
        assert module in ("dsv4_smoke_utils", "dsv4_trained_utils"), path.name
        assert f"def {func}(" in (path.parent / f"{module}.py").read_text(), path.name


def test_smoke_dataset_loader() -> None:
    pytest.importorskip("datasets")
    u = _smoke_utils()
    dd = u.load_smoke_dataset(name="arith", version=1.0)
    assert set(dd) == {"test", "fewshot"} and len(dd["test"]) == 16
    assert len(u.load_smoke_dataset(name="choice")["test"]) == 16


def test_read_jsonl_reports_bad_line(tmp_path: Path) -> None:
    u = _smoke_utils()
    p = tmp_path / "x.jsonl"
    p.write_text('{"a": 1}\n\n{oops\n')
    with pytest.raises(ValueError, match=r"x.jsonl:3"):
        u.read_jsonl(p)


def test_eval_config_errors(tmp_path: Path) -> None:
    p = tmp_path / "e.yaml"
    cases = {
        "kind: bench\ntasks: [a]\n": "kind: lm_eval",
        "kind: lm_eval\ntasks: []\n": "non-empty list",
        "kind: lm_eval\ntasks: [a]\nfoo: 1\n": r"unknown keys \['foo'\]",
        "kind: lm_eval\ntasks: [a]\ngates: [{task: b, metric: acc, baseline: 1, stderr: 0}]\n":
            "not in tasks",
        "kind: lm_eval\ntasks: [a]\ngates: [{task: a, metric: acc, bogus: 1}]\n": "bogus",
        "kind: lm_eval\ntasks: [a]\ngates: [{task: a, metric: acc, baseline: .nan}]\n":
            "finite number",
        "kind: lm_eval\ntasks: [a]\ngates: [{task: a, metric: acc, abs_tol: -1}]\n": ">= 0",
        "kind: lm_eval\ntasks: [a]\nmodel_args: {base_url: x}\n": "set by the runner",
        "kind: lm_eval\ntasks: [a]\ninclude_path: nowhere\n": "not a directory",
        "kind: lm_eval\ntasks: [a]\nnum_fewshot: -1\n": "num_fewshot",
    }  # fmt: skip
    for text, msg in cases.items():
        p.write_text(text)
        with pytest.raises(R.ConfigError, match=msg):
            R.load_eval_config(p)


def test_lm_eval_command(tmp_path: Path) -> None:
    ev = R.load_eval_config(SMOKE)
    cmd = R.build_lm_eval_command(
        ev, base_url="http://127.0.0.1:9/", model_name="tiny-dsv4", tokenizer="/tok,dir",
        output_path=tmp_path, limit=3.0,
    )  # fmt: skip
    assert cmd[1:7] == ["-m", "lm_eval", "run", "--model", "local-completions", "--model_args"]
    ma = json.loads(cmd[7])
    assert ma["base_url"] == "http://127.0.0.1:9/v1/completions"
    assert ma["model"] == "tiny-dsv4" and ma["tokenizer"] == "/tok,dir"  # comma survives: JSON
    assert ma["tokenizer_backend"] == "huggingface" and ma["tokenized_requests"] is False
    assert ma["num_concurrent"] == 1
    i = cmd.index("--tasks")
    assert cmd[i + 1] == "dsv4_smoke_arith,dsv4_smoke_choice"
    assert cmd[cmd.index("--include_path") + 1] == str(ev.include_path)
    assert cmd[cmd.index("--limit") + 1] == "3" and "--log_samples" in cmd
    assert "--num_fewshot" not in cmd  # the tasks carry their own few-shot count
    # gsm8k gate: 5-shot, limit from config (none)
    g = R.build_lm_eval_command(
        R.load_eval_config(GSM8K), base_url="http://h:1", model_name="m", tokenizer="m",
        output_path=tmp_path,
    )  # fmt: skip
    assert g[g.index("--num_fewshot") + 1] == "5" and "--limit" not in g
    # remote/none tokenizer backends take no local tokenizer
    ev2 = R.EvalConfig(**{**ev.__dict__, "model_args": {"tokenizer_backend": "remote"}})
    ma2 = json.loads(R.build_lm_eval_command(ev2, base_url="http://h:1", model_name="m",
                                             tokenizer="t", output_path=tmp_path)[7])  # fmt: skip
    assert "tokenizer" not in ma2


def test_lm_eval_command_parses_with_lm_eval(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    import argparse

    from lm_eval._cli.run import Run

    top = argparse.ArgumentParser()
    sub = top.add_subparsers(dest="command")
    Run.create(sub)
    ev = R.load_eval_config(GSM8K)
    cmd = R.build_lm_eval_command(ev, base_url="http://h:1", model_name="m", tokenizer="m,x",
                                  output_path=tmp_path)  # fmt: skip
    a = top.parse_args(cmd[3:])
    assert a.model == "local-completions"
    assert a.model_args["tokenizer"] == "m,x" and a.model_args["num_concurrent"] == 64
    assert a.tasks == ["gsm8k"] and a.num_fewshot == 5 and a.log_samples
    assert a.seed == [0, 0, 0, 0]


# ---------------------------------------------------------------- gate math


def _gate(**kw) -> R.Gate:
    return R.Gate(**{"task": "t", "metric": "acc", **kw})


def test_gate_math() -> None:
    g = _gate(baseline=0.5, stderr=0.1, k_stderr=2.0)
    res = {"t": {"acc,none": 0.3, "acc_stderr,none": 0.09}}
    r = R.evaluate_gate(g, res)
    assert r.passed and r.lower == pytest.approx(0.3) and r.upper is None
    assert r.ratio == pytest.approx(0.6) and r.score_stderr == 0.09
    assert R.evaluate_gate(g, {"t": {"acc,none": 0.2999}}).passed is False
    # abs_tol wins over k*stderr; two-sided fails above
    g2 = _gate(baseline=0.5, stderr=0.1, abs_tol=0.01, two_sided=True)
    assert R.evaluate_gate(g2, {"t": {"acc,none": 0.509}}).passed
    assert R.evaluate_gate(g2, {"t": {"acc,none": 0.52}}).passed is False
    assert R.evaluate_gate(g2, {"t": {"acc,none": 0.48}}).passed is False
    # exact-equality gate survives JSON float round trips
    g0 = _gate(baseline=0.1 + 0.2, abs_tol=0.0, two_sided=True)
    assert R.evaluate_gate(g0, json.loads(json.dumps({"t": {"acc,none": 0.3}}))).passed
    # a missing score fails; "N/A" counts as missing
    assert R.evaluate_gate(g, {"t": {}}).passed is False
    assert R.evaluate_gate(g, {"t": {"acc,none": "N/A"}}).passed is False
    # no baseline anywhere -> not evaluated
    assert R.evaluate_gate(_gate(stderr=0.1), res).passed is None


def test_gate_baseline_from_run() -> None:
    g = _gate(filter="strict-match", baseline=0.9, stderr=0.001, k_stderr=2)
    base = {"t": {"acc,strict-match": 0.5, "acc_stderr,strict-match": 0.05}}
    r = R.evaluate_gate(g, {"t": {"acc,strict-match": 0.41}}, base, "b.json")
    assert r.baseline == 0.5 and r.stderr == 0.05 and r.lower == pytest.approx(0.4)
    assert r.passed and r.baseline_source == "b.json"
    # baseline run lacks the metric -> not evaluated, says so
    r = R.evaluate_gate(g, {"t": {"acc,strict-match": 0.41}}, {"t": {}}, "b.json")
    assert r.passed is None and "b.json has no t/acc,strict-match" in r.message
    # neither abs_tol nor any stderr: a config error, not a silent pass
    with pytest.raises(R.ConfigError, match="needs abs_tol or a stderr"):
        R.evaluate_gate(_gate(), {"t": {"acc,none": 1}}, {"t": {"acc,none": 1}}, "b")


def test_gate_table_renders() -> None:
    rows = [
        R.evaluate_gate(_gate(baseline=0.5, abs_tol=0.0), {"t": {"acc,none": 0.5}}),
        R.evaluate_gate(_gate(baseline=0.5, abs_tol=0.0), {"t": {"acc,none": 0.4}}),
        R.evaluate_gate(_gate(), {"t": {"acc,none": 0.4}}),
    ]
    text = R.format_gate_table(rows)
    assert "PASS" in text and "FAIL" in text and "NOT GATED" in text
    assert R.verdict(rows) == R.EXIT_GATE_FAILED
    assert R.verdict(rows[:1]) == R.EXIT_PASS


# ---------------------------------------------------------------- bench math


def test_bench_compare_math() -> None:
    base = {"mean_ttft_ms": 40.0, "p99_tpot_ms": 10.0, "output_throughput": 100.0}
    new = {"mean_ttft_ms": 44.0, "p99_tpot_ms": 9.0, "output_throughput": 80.0,
           "mean_tpot_ms": 5.0}  # fmt: skip
    rows = {r.metric: r for r in R.compare_bench(new, base)}
    assert set(rows) == {"mean_ttft_ms", "p99_tpot_ms", "output_throughput", "mean_tpot_ms"}
    assert rows["mean_ttft_ms"].ratio == pytest.approx(1.1)
    assert rows["mean_ttft_ms"].regression == pytest.approx(0.1)  # slower = worse
    assert rows["p99_tpot_ms"].regression == pytest.approx(-0.1)  # faster = better
    assert rows["output_throughput"].ratio == pytest.approx(0.8)
    assert rows["output_throughput"].regression == pytest.approx(0.25)  # 100/80 - 1
    assert rows["mean_tpot_ms"].ratio is None  # no baseline value
    ok, why = R.bench_gate(list(rows.values()), None)
    assert ok and not why
    ok, why = R.bench_gate(list(rows.values()), 0.3)
    assert not ok and why == ["mean_tpot_ms: missing in baseline"]
    ok, why = R.bench_gate([rows["mean_ttft_ms"], rows["output_throughput"]], 0.2)
    assert not ok and len(why) == 1 and why[0].startswith("output_throughput: +25.0%")
    zero = R.BenchRow("output_throughput", True, 10.0, 0.0)
    assert zero.regression == math.inf
    assert R.BenchRow("x", False, 0.0, 1.0).ratio is None
    text = R.format_bench_table(list(rows.values()))
    assert "1.100" in text and "+10.0%" in text and "n/a" in text


def test_bench_result_unwraps_summary() -> None:
    raw = {"mean_ttft_ms": 1.0}
    assert R.bench_result(raw) == raw
    assert R.bench_result({"kind": "bench", "result": raw}) == raw


# ---------------------------------------------------------------- CLI


def test_cli_help_and_dry_run(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        R.main(["--help"])
    assert e.value.code == 0
    assert "serve-eval" in capsys.readouterr().out
    assert R.main(["serve-bench", str(FP4), str(CONFIGS / "bench" / "decode-heavy.yaml"),
                   "--dry-run", "--port", "8123", "--out-dir", "/o"]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    assert "serve --config" in out[0] and "--port 8123" in out[0]
    assert "bench serve" in out[1] and "--result-dir /o" in out[1]
    assert R.main(["serve-eval", str(FP8), str(GSM8K), "--dry-run",
                   "--base-url", "http://gpu:8000"]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "http://gpu:8000/v1/completions" in out[0]


def test_run_client_records_and_logs_the_client(tmp_path: Path, capsys) -> None:
    """The client run serve-eval and serve-bench share: with ``--base-url`` no server starts,
    the command lands in the summary's ``commands`` and its output in ``<name>.log``."""
    import argparse

    from vllm_dsv4_backend.run import cli

    cmd = [sys.executable, "-c", "print('client ran')"]
    urls: list[str] = []

    def client(url: str) -> list[str]:
        urls.append(url)
        return cmd

    args = argparse.Namespace(dry_run=False, base_url="http://gpu:8000/")
    session = cli._Session(R.load_serve_config(TINY), args, tmp_path / "o", dict(os.environ))
    before = time.monotonic()
    t0 = cli._run_client(session, client, "bench", "the client")
    assert t0 is not None and before <= t0 <= time.monotonic()
    assert urls == ["http://gpu:8000"]
    assert session.commands == {"bench": shlex.join(cmd)}
    assert "client ran" in (tmp_path / "o" / "bench.log").read_text()
    assert f"running the client (log: {tmp_path / 'o' / 'bench.log'})" in capsys.readouterr().err

    dry = cli._Session(session.serve, argparse.Namespace(dry_run=True, base_url="http://h:1"),
                       tmp_path / "dry", {})
    assert cli._run_client(dry, client, "bench", "the client") is None
    assert capsys.readouterr().out.splitlines() == [shlex.join(cmd)]
    assert urls[-1] == "http://h:1" and not (tmp_path / "dry").exists() and not dry.commands


def test_cli_config_errors_exit_2(tmp_path: Path, capsys) -> None:
    # smoke gates have no baseline in the config: --baseline or --no-gate required
    assert R.main(["serve-eval", str(TINY), str(SMOKE), "--dry-run"]) == R.EXIT_CONFIG
    assert "--no-gate" in capsys.readouterr().err
    assert R.main(["serve-eval", str(TINY), str(SMOKE), "--dry-run", "--no-gate"]) == 0
    assert R.main(["serve-eval", str(TINY), str(SMOKE), "--baseline",
                   str(tmp_path / "nope.json")]) == R.EXIT_CONFIG  # fmt: skip
    assert R.main(["serve-eval", str(TINY), str(GSM8K), "--env", "NOEQUALS",
                   "--out-dir", str(tmp_path / "o")]) == R.EXIT_CONFIG  # fmt: skip
    assert R.main(["serve-bench", str(TINY), str(GSM8K), "--dry-run"]) == R.EXIT_CONFIG


def test_cli_compare_commands(tmp_path: Path, capsys) -> None:
    def dump(name: str, data: dict) -> str:
        p = tmp_path / name
        p.write_text(json.dumps(data))
        return str(p)

    keys = ["exact_match,strict-match", "exact_match,flexible-extract",
            "acc,none", "acc_norm,none"]  # fmt: skip
    res = {"dsv4_smoke_arith": {k: 0.25 for k in keys[:2]},
           "dsv4_smoke_choice": {k: 0.5 for k in keys[2:]}}  # fmt: skip
    same = dump("same.json", {"results": res})
    other = json.loads(json.dumps(res))
    other["dsv4_smoke_choice"]["acc,none"] = 0.4375
    diff = dump("diff.json", {"results": other})
    assert R.main(["compare-eval", same, str(SMOKE), "--baseline", same]) == 0
    assert R.main(["compare-eval", diff, str(SMOKE), "--baseline", same]) == 1
    assert "FAIL" in capsys.readouterr().out
    # gsm8k gate straight from the config
    gsm = dump(
        "g.json",
        {
            "results": {
                "gsm8k": {"exact_match,strict-match": 0.95, "exact_match,flexible-extract": 0.93}
            }
        },
    )
    assert R.main(["compare-eval", gsm, str(GSM8K)]) == 1
    b1 = dump("b1.json", {"mean_ttft_ms": 10.0, "output_throughput": 100.0, "failed": 0})
    b2 = dump(
        "b2.json", {"kind": "bench", "result": {"mean_ttft_ms": 10.5, "output_throughput": 99.0}}
    )
    assert R.main(["compare-bench", b1, "--baseline", b2]) == 0
    assert R.main(["compare-bench", b1, "--baseline", b2, "--max-regression", "0.001"]) == 0
    assert R.main(["compare-bench", b2, "--baseline", b1, "--max-regression", "0.01"]) == 1
    failed = dump("f.json", {"mean_ttft_ms": 1.0, "failed": 2, "errors": ["boom", ""]})
    assert R.main(["compare-bench", failed, "--baseline", b1]) == R.EXIT_RUNTIME


# ---------------------------------------------------------------- server lifecycle

_FAKE_SERVER = textwrap.dedent(
    """
    import http.server, os, subprocess, sys, time
    delay, port, pidfile = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    # a child in the same process group, like vLLM's engine core
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    open(pidfile, "w").write(str(child.pid))
    print("fake server starting", flush=True)
    if delay < 0:
        print("fatal: cannot load model", flush=True)
        sys.exit(7)
    t0 = time.monotonic()
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/health" and time.monotonic() - t0 > delay
            self.send_response(200 if ok else 503)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _fake(tmp_path: Path, delay: float) -> tuple[R.ServerProcess, Path]:
    script = tmp_path / "fake.py"
    script.write_text(_FAKE_SERVER)
    port = R.find_free_port()
    pidfile = tmp_path / "child.pid"
    cmd = [sys.executable, str(script), str(delay), str(port), str(pidfile)]
    return R.ServerProcess(cmd, host="127.0.0.1", port=port,
                           log_path=tmp_path / "server.log"), pidfile  # fmt: skip


def _child_pid(pidfile: Path) -> int:
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text():
            return int(pidfile.read_text())
        time.sleep(0.05)
    raise AssertionError("fake server did not write its child pid")


def test_server_waits_for_health_and_stops_process_group(tmp_path: Path) -> None:
    import io

    srv, pidfile = _fake(tmp_path, delay=1.0)
    progress = io.StringIO()
    with srv:
        waited = srv.wait_healthy(timeout=60, progress=progress, interval=0.1)
        assert waited >= 1.0 and srv.is_healthy()
        child = _child_pid(pidfile)
        assert _alive(child)
    assert srv.proc.poll() is not None
    for _ in range(50):
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child), "stop() must take the whole process group down"
    assert "server healthy" in progress.getvalue()
    assert "fake server starting" in srv.log_path.read_text()


def test_server_crash_reports_log_tail(tmp_path: Path) -> None:
    srv, pidfile = _fake(tmp_path, delay=-1)
    with srv, pytest.raises(R.RunError) as e:
        srv.wait_healthy(timeout=60, interval=0.1)
    msg = str(e.value)
    assert "exited with code 7" in msg and "fatal: cannot load model" in msg
    assert str(srv.log_path) in msg
    child = _child_pid(pidfile)
    for _ in range(50):
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child), "a crashed server's children must not outlive it"


def test_server_health_timeout(tmp_path: Path) -> None:
    srv, _ = _fake(tmp_path, delay=1000)
    # The error names the 1 s timeout it gave up at; how long that took is the machine's.
    with srv, pytest.raises(R.RunError, match=r"did not answer .*/health within 1 s"):
        srv.wait_healthy(timeout=1.0, interval=0.1)
    assert srv.proc.poll() is not None


def test_server_on_a_taken_port_is_not_healthy(tmp_path: Path) -> None:
    """Two servers started together on one port: ``vllm serve`` binds with SO_REUSEADDR
    at start and listens only when its engine is up, so both binds succeed and the first
    to listen answers both URLs (the tp2pp2 server of test_parallel_layouts once read
    the pp2 server's /metrics this way). The one that does not hold the listener never
    counts as healthy; its wait fails naming the other process."""
    (tmp_path / "a").mkdir()
    a, _ = _fake(tmp_path / "a", delay=0)
    # b's process never listens, like a vLLM server still loading its model.
    b = R.ServerProcess([sys.executable, "-c", "import time; time.sleep(300)"],
                        host="127.0.0.1", port=a.port, log_path=tmp_path / "b.log")
    with a, b:
        a.wait_healthy(timeout=60, interval=0.1)
        assert a.owns_port() and a.is_healthy()
        assert not b.owns_port() and not b.is_healthy()
        with pytest.raises(R.RunError, match=r"within 1 s \(another process listens"):
            b.wait_healthy(timeout=1.0, interval=0.1)


def test_find_free_port_never_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    """The OS may offer a port twice (it picks at random, and a server has not bound
    it yet); the runner hands each out once. The double replays the OS's choice, which
    no test can force."""
    import socket

    from vllm_dsv4_backend.run import server

    offered = iter([40001, 40001, 40001, 40002])

    class _Socket:
        def __init__(self, *a: object) -> None:
            self.port = 0

        def __enter__(self) -> _Socket:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, addr: tuple[str, int]) -> None:
            self.port = next(offered)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(server, "_handed_out", set())
    monkeypatch.setattr(server.socket, "socket", _Socket)
    assert [server.find_free_port(), server.find_free_port()] == [40001, 40002]
    monkeypatch.undo()
    assert socket.socket is not _Socket and server.find_free_port() > 0


def test_run_logged_failure_has_tail(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "print('lm_eval exploded'); raise SystemExit(4)"]
    with pytest.raises(R.RunError, match=r"(?s)exit code 4.*lm_eval exploded"):
        R.run_logged(cmd, tmp_path / "x.log", dict(os.environ), "lm_eval")
    R.run_logged([sys.executable, "-c", "pass"], tmp_path / "y.log", dict(os.environ), "ok")


def test_console_script_help() -> None:
    """`python -m vllm_dsv4_backend.run --help` works without vLLM or lm_eval imports."""
    code = (
        "import sys, runpy; sys.argv=['vllm-dsv4-run','--help'];\n"
        "try:\n runpy.run_module('vllm_dsv4_backend.run', run_name='__main__')\n"
        "except SystemExit as e: assert e.code == 0\n"
        "assert 'vllm' not in sys.modules and 'lm_eval' not in sys.modules, 'heavy import'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "serve-bench" in out.stdout and "exit codes" in out.stdout


def test_one_tiny_server_definition() -> None:
    """The tiny server is defined once (the YAML, with its seed); the script and the
    tests' fixture serve that file instead of repeating its flags."""
    assert R.TINY_SERVE_CONFIG == TINY
    assert R.load_serve_config(TINY).raw["seed"] == 0
    script = (ROOT / "scripts" / "serve_tiny.sh").read_text()
    fixture = (ROOT / "tests" / "vllm" / "conftest.py").read_text()
    assert "configs/serve/tiny-dsv4-cpu.yaml" in script and "TINY_SERVE_CONFIG" in fixture
    for flag in ("--attention-backend", "--kv-cache-dtype", "--load-format", "--max-model-len"):
        assert flag not in script and flag not in fixture, flag
    # The fixture drives the runner's server process, not a copy of it.
    assert "make_server" in fixture and "Popen" not in fixture
