# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm-dsv4-run``: serve a config, evaluate or benchmark it, compare with a baseline.

One command runs a whole check the way a user would by hand::

    vllm-dsv4-run serve-eval  SERVE.yaml EVAL.yaml  [--baseline RUN.json]
    vllm-dsv4-run serve-bench SERVE.yaml BENCH.yaml [--baseline RUN.json]
    vllm-dsv4-run compare-eval  RESULT.json EVAL.yaml [--baseline RUN.json]
    vllm-dsv4-run compare-bench RESULT.json --baseline RUN.json

``serve-*`` starts ``vllm serve --config SERVE.yaml`` in a subprocess (log to a
file), waits for ``/health`` (progress line, timeout, log tail on failure),
runs lm_eval (``local-completions``) or ``vllm bench serve`` against it, saves
JSON results, stops the server (always: also on errors and Ctrl-C) and prints
the comparison with the baseline. Exit codes: 0 pass, 1 gate failed,
2 bad configuration or arguments, 3 server, harness or benchmark failure,
130 interrupted.

Config files (see ``configs/``):

- serve: a plain ``vllm serve --config`` YAML (vLLM's own format; the runner
  never adds keys to it, so it also works by hand).
- eval (``kind: lm_eval``): tasks, few-shot, lm_eval model args and *gates*.
- bench (``kind: vllm_bench_serve``): ``vllm bench serve`` flags under
  ``args``. vLLM 0.32's ``vllm bench serve --config`` inserts the config's
  flags *before* the ``serve`` sub-command and fails, so the runner expands the
  flags itself with the same rules as vLLM's ``load_config_file``.

This module imports neither vLLM nor lm_eval: both run as subprocesses, so
``--help``, ``--dry-run`` and the ``compare-*`` commands work anywhere.

The jobs live in :mod:`.config` (config files -> command lines), :mod:`.gates`
(pass/fail), :mod:`.server` (the ``vllm serve`` process) and here (the CLI).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_dsv4_backend.run.common import (
    EXIT_CONFIG,
    EXIT_GATE_FAILED,
    EXIT_INTERRUPTED,
    EXIT_PASS,
    EXIT_RUNTIME,
    PREFIX,
    ConfigError,
    RunError,
)
from vllm_dsv4_backend.run.config import (
    EvalConfig,
    ServeConfig,
    apply_overrides,
    build_bench_command,
    build_lm_eval_command,
    build_serve_command,
    load_bench_config,
    load_eval_config,
    load_serve_config,
)
from vllm_dsv4_backend.run.gates import (
    BenchRow,
    bench_gate,
    bench_result,
    compare_bench,
    format_bench_table,
    format_gate_table,
    gate_eval,
    task_results,
    verdict,
)
from vllm_dsv4_backend.run.server import ServerProcess, find_free_port, tail

__all__ = [
    "default_out_dir",
    "find_lm_eval_results",
    "main",
    "make_parser",
    "parse_env_pairs",
    "run_logged",
]


def _offline_env(env: dict[str, str]) -> None:
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env[k] = "1"


def parse_env_pairs(pairs: Sequence[str]) -> dict[str, str]:
    """``["K=V", ...]`` -> dict; a pair without ``=`` -> ConfigError."""
    out = {}
    for item in pairs:
        if "=" not in item or not item.split("=", 1)[0]:
            raise ConfigError(f"--env expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        out[k] = v
    return out


def run_logged(cmd: Sequence[str], log_path: Path, env: Mapping[str, str], what: str) -> None:
    """Run ``cmd`` to completion with output to ``log_path``; non-zero exit -> RunError."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        log.flush()
        rc = subprocess.call(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=dict(env))
    if rc != 0:
        raise RunError(
            f"{what} failed with exit code {rc}.\ncommand: {shlex.join(cmd)}\nlog: {log_path}\n"
            f"--- last lines ---\n{tail(log_path)}"
        )


def find_lm_eval_results(output_path: Path) -> Path:
    """The newest ``results_*.json`` lm_eval wrote under ``output_path``."""
    found = sorted(output_path.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RunError(f"lm_eval wrote no results_*.json under {output_path}")
    return found[-1]


def default_out_dir(*names: str) -> Path:
    """``$DSV4_SCRATCH/runs/<stamp>-<names>`` (scripts/env.sh sets it) or ``./dsv4-runs/...``."""
    root = (
        Path(os.environ["DSV4_SCRATCH"]) / "runs"
        if "DSV4_SCRATCH" in os.environ
        else Path("dsv4-runs")
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return root / "-".join([stamp, *names])


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def _say(msg: str) -> None:
    print(f"{PREFIX} {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so ``finally`` blocks stop the server."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. called from a test worker)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@dataclasses.dataclass(frozen=True)
class _Session:
    """One serve-eval / serve-bench run: what its server and its client are started with."""

    serve: ServeConfig
    args: argparse.Namespace
    out_dir: Path
    env: dict[str, str]
    # Every command started, by name ("serve", then the client's), for the summary.
    commands: dict[str, str] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def served(session: _Session) -> Iterator[str]:
    """Yield a base URL: ``--base-url`` as given, or a fresh server that is stopped after."""
    args = session.args
    if args.base_url:
        _say(f"using the running server at {args.base_url} (not starting one)")
        yield args.base_url.rstrip("/")
        return
    port = args.port or find_free_port(args.host)
    cmd = build_serve_command(session.serve, host=args.host, port=port, extra_args=args.serve_arg)
    session.commands["serve"] = shlex.join(cmd)
    server = ServerProcess(
        cmd, host=args.host, port=port, log_path=session.out_dir / "server.log", env=session.env
    )
    _say(f"starting vLLM: {shlex.join(cmd)}")
    _say(f"server log: {server.log_path}")
    try:
        server.start()
        server.wait_healthy(timeout=args.health_timeout, progress=sys.stderr)
        yield server.base_url
    finally:
        rc = server.stop()
        _say(f"server stopped (exit code {rc})")


def _common_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    if args.offline:
        _offline_env(env)
    env.update(parse_env_pairs(args.env))
    return env


def _load_baseline(path: str | None) -> dict[str, Any] | None:
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--baseline {path!r} does not exist")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"--baseline {path}: not valid JSON ({e})") from e


def _check_gates_evaluable(ev: EvalConfig, baseline: Mapping[str, Any] | None) -> None:
    if baseline is None:
        missing = [f"{g.task}/{g.key}" for g in ev.gates if g.baseline is None]
        if missing:
            raise ConfigError(
                f"{ev.path}: gates {missing} have no baseline in the config; pass "
                "--baseline RUN.json (e.g. a run with VLLM_DSV4_ATTN_IMPL=vllm) or --no-gate"
            )


def _dry_run_server(serve: ServeConfig, args: argparse.Namespace) -> str:
    """``--dry-run``: print the server command (unless ``--base-url``); the URL to use."""
    if args.base_url:
        return args.base_url
    port = args.port or 8000
    print(shlex.join(build_serve_command(serve, host=args.host, port=port,
                                         extra_args=args.serve_arg)))
    return f"http://{args.host}:{port}"


def _run_client(
    session: _Session, client_cmd: Callable[[str], list[str]], name: str, what: str
) -> float | None:
    """Run the client ``client_cmd(url)`` against :func:`served`, once (eval and bench share it).

    Its command goes to ``session.commands[name]``, its output to ``out_dir / f"{name}.log"``;
    ``what`` names it in messages. With ``--dry-run`` only the commands are printed and the
    result is None; else it is the ``time.monotonic()`` taken before the server started (the
    summaries' ``wall_s`` counts the server start).
    """
    out_dir = session.out_dir
    if session.args.dry_run:
        print(shlex.join(client_cmd(_dry_run_server(session.serve, session.args))))
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    _say(f"results go to {out_dir}")
    t0 = time.monotonic()
    with served(session) as url:
        cmd = client_cmd(url)
        session.commands[name] = shlex.join(cmd)
        log_path = out_dir / f"{name}.log"
        _say(f"running {what} (log: {log_path})")
        run_logged(cmd, log_path, session.env, what)
    return t0


def cmd_serve_eval(args: argparse.Namespace) -> int:
    serve = load_serve_config(args.serve_config)
    ev = load_eval_config(args.eval_config)
    baseline = _load_baseline(args.baseline)
    if not args.no_gate:
        _check_gates_evaluable(ev, baseline)
    out_dir = Path(args.out_dir) if args.out_dir else default_out_dir(serve.name, ev.name)
    session = _Session(serve, args, out_dir, _common_env(args))
    lm_out = out_dir / "lm_eval"

    def lm_eval_cmd(url: str) -> list[str]:
        return build_lm_eval_command(ev, base_url=url, model_name=serve.served_model_name,
                                     tokenizer=serve.tokenizer, output_path=lm_out,
                                     limit=args.limit)

    t0 = _run_client(session, lm_eval_cmd, "lm_eval", "lm_eval")
    if t0 is None:
        return EXIT_PASS
    res_path = find_lm_eval_results(lm_out)
    lm = json.loads(res_path.read_text())
    rows = [] if args.no_gate else gate_eval(ev.gates, lm["results"], baseline, str(args.baseline))
    code = verdict(rows)
    summary = {
        "kind": "eval",
        "serve_config": str(serve.path),
        "eval_config": str(ev.path),
        "served_model_name": serve.served_model_name,
        "env": {k: v for k, v in parse_env_pairs(args.env).items()},
        "commands": session.commands,
        "lm_eval_results_file": str(res_path),
        "results": lm["results"],
        "n-samples": lm.get("n-samples"),
        "configs_n_shot": lm.get("n-shot"),
        "wall_s": round(time.monotonic() - t0, 1),
        "baseline": args.baseline,
        "gates": [r.to_json() for r in rows],
        "passed": code == EXIT_PASS,
    }
    _write_json(out_dir / "eval-summary.json", summary)
    print(_results_table(lm["results"]))
    if rows:
        print()
        print(format_gate_table(rows))
    _say(f"summary: {out_dir / 'eval-summary.json'}")
    _say("PASS" if code == EXIT_PASS else "FAIL: a gate is outside its accepted range")
    return code


def _results_table(results: Mapping[str, Any]) -> str:
    lines = [f"{'task':<22} {'metric':<32} {'value':>8} {'stderr':>8}"]
    for task, table in results.items():
        for key, v in table.items():
            if "," not in key or "_stderr," in key or not isinstance(v, int | float):
                continue
            metric, flt = key.split(",", 1)
            se = table.get(f"{metric}_stderr,{flt}")
            se_s = f"{se:.4f}" if isinstance(se, int | float) else "n/a"
            lines.append(f"{task:<22} {key:<32} {v:>8.4f} {se_s:>8}")
    return "\n".join(lines)


def cmd_serve_bench(args: argparse.Namespace) -> int:
    serve = load_serve_config(args.serve_config)
    bench = load_bench_config(args.bench_config)
    baseline = _load_baseline(args.baseline)
    max_reg = args.max_regression if args.max_regression is not None else bench.max_regression
    out_dir = Path(args.out_dir) if args.out_dir else default_out_dir(serve.name, bench.name)
    session = _Session(serve, args, out_dir, _common_env(args))
    result_name = "bench-result.json"
    apply_overrides(bench.args, args.set)  # validate before starting anything

    def bench_cmd(url: str) -> list[str]:
        return build_bench_command(
            bench,
            base_url=url,
            model_name=serve.served_model_name,
            tokenizer=serve.tokenizer,
            tokenizer_mode=serve.tokenizer_mode,
            result_dir=out_dir,
            result_filename=result_name,
            overrides=args.set,
        )

    t0 = _run_client(session, bench_cmd, "bench", "vllm bench serve")
    if t0 is None:
        return EXIT_PASS
    raw = json.loads((out_dir / result_name).read_text())
    return _finish_bench(
        raw,
        baseline,
        args.baseline,
        max_reg,
        out_dir,
        {
            "serve_config": str(serve.path),
            "bench_config": str(bench.path),
            "env": parse_env_pairs(args.env),
            "commands": session.commands,
            "wall_s": round(time.monotonic() - t0, 1),
        },
    )


_BENCH_KEEP = (
    "date",
    "backend",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "errors",
)


def _finish_bench(
    raw: Mapping[str, Any],
    baseline: Mapping[str, Any] | None,
    baseline_name: str | None,
    max_reg: float | None,
    out_dir: Path | None,
    meta: dict[str, Any],
) -> int:
    keep = {k: v for k, v in raw.items() if k in _BENCH_KEEP or k.endswith("_ms")}
    failed = int(raw.get("failed") or 0)
    errors = [e for e in raw.get("errors") or [] if e]
    code = EXIT_PASS
    reasons: list[str] = []
    if failed or errors:
        code = EXIT_RUNTIME
        reasons.append(f"{failed} request(s) failed: {errors[:3]}")
    rows: list[BenchRow] = []
    if baseline is not None:
        rows = compare_bench(raw, bench_result(baseline))
        ok, why = bench_gate(rows, max_reg)
        if not ok and code == EXIT_PASS:
            code = EXIT_GATE_FAILED
        reasons += why
    summary = {
        "kind": "bench",
        **meta,
        "baseline": baseline_name,
        "max_regression": max_reg,
        "result": keep,
        "comparison": [
            dict(dataclasses.asdict(r), ratio=r.ratio, regression=r.regression) for r in rows
        ],
        "passed": code == EXIT_PASS,
        "reasons": reasons,
    }
    if out_dir is not None:
        _write_json(out_dir / "bench-summary.json", summary)
        _say(f"summary: {out_dir / 'bench-summary.json'}")
    if rows:
        print(format_bench_table(rows))
    else:
        print(format_bench_table(compare_bench(raw, {})))
    for r in reasons:
        _say(r)
    _say("PASS" if code == EXIT_PASS else "FAIL")
    return code


def _load_result(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``compare-*``: the result JSON (required) and the ``--baseline`` JSON (if given)."""
    data = _load_baseline(args.result)
    assert data is not None  # the positional argument is required
    return data, _load_baseline(args.baseline)


def cmd_compare_eval(args: argparse.Namespace) -> int:
    ev = load_eval_config(args.eval_config)
    data, baseline = _load_result(args)
    _check_gates_evaluable(ev, baseline)
    rows = gate_eval(ev.gates, task_results(data, args.result), baseline, str(args.baseline))
    print(format_gate_table(rows))
    code = verdict(rows)
    _say("PASS" if code == EXIT_PASS else "FAIL: a gate is outside its accepted range")
    return code


def cmd_compare_bench(args: argparse.Namespace) -> int:
    data, baseline = _load_result(args)
    return _finish_bench(bench_result(data), baseline, args.baseline, args.max_regression, None, {})


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

_EPILOG = """\
examples (from the repo root, after `source scripts/env.sh`):
  # tiny CPU model: vLLM's own attention as the baseline, then the plugin against it
  vllm-dsv4-run serve-eval configs/serve/tiny-dsv4-cpu.yaml configs/lm_eval/tiny-smoke.yaml \\
      --env VLLM_DSV4_ATTN_IMPL=vllm --no-gate --out-dir .scratch/runs/tiny-vllm
  vllm-dsv4-run serve-eval configs/serve/tiny-dsv4-cpu.yaml configs/lm_eval/tiny-smoke.yaml \\
      --env VLLM_DSV4_ATTN_IMPL=plugin --baseline .scratch/runs/tiny-vllm/eval-summary.json
  # production GSM8K gate (4 GPUs)
  vllm-dsv4-run serve-eval configs/serve/deepseek-v4-flash-tp4-fp4idx.yaml \\
      configs/lm_eval/gsm8k-gate.yaml
  # decode-heavy benchmark, compared with an earlier run
  vllm-dsv4-run serve-bench configs/serve/deepseek-v4-flash-tp4-fp4idx.yaml \\
      configs/bench/decode-heavy.yaml --baseline runs/before/bench-summary.json

exit codes: 0 pass, 1 gate failed, 2 bad config/arguments,
            3 server/lm_eval/benchmark failure, 130 interrupted
"""


def _add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    g.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    g.add_argument(
        "--health-timeout",
        type=float,
        default=900.0,
        metavar="S",
        help="seconds to wait for /health (default: 900)",
    )
    g.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for the server and the client, e.g. "
        "VLLM_DSV4_ATTN_IMPL=vllm (repeatable)",
    )
    g.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `vllm serve` argument, overrides the config; use the "
        "--serve-arg=--flag form for flags (repeatable)",
    )
    g.add_argument(
        "--base-url", default=None, help="use this running server instead of starting one"
    )
    g.add_argument(
        "--offline",
        action="store_true",
        help="set HF_HUB_OFFLINE/HF_DATASETS_OFFLINE/TRANSFORMERS_OFFLINE=1",
    )
    p.add_argument(
        "--out-dir",
        default=None,
        help="where logs and JSON go (default: $DSV4_SCRATCH/runs/<stamp>-... "
        "or ./dsv4-runs/<stamp>-...)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        metavar="RUN.json",
        help="earlier run summary (or raw lm_eval / vllm bench JSON) to compare with",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the commands and exit without starting anything",
    )


def _serve_subparser(sub: Any, name: str, help_: str, config: str,
                     config_help: str) -> argparse.ArgumentParser:
    """A ``serve-*`` command: the serve config, its own config, the server arguments."""
    p = sub.add_parser(name, help=help_, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=_EPILOG)
    p.add_argument("serve_config", help="vllm serve --config YAML (configs/serve/...)")
    p.add_argument(config, help=config_help)
    _add_server_args(p)
    return p


def make_parser() -> argparse.ArgumentParser:
    """The ``vllm-dsv4-run`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="vllm-dsv4-run",
        description="Serve a DeepSeek-V4 config with vLLM, run lm_eval or `vllm bench serve` "
        "against it, save JSON results and compare them with a baseline.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _serve_subparser(sub, "serve-eval", "serve, run lm_eval, check the gates",
                         "eval_config", "eval YAML, kind: lm_eval (configs/lm_eval/...)")
    p.add_argument(
        "--limit",
        type=float,
        default=None,
        help="lm_eval --limit override (samples per task, or a fraction < 1)",
    )
    p.add_argument(
        "--no-gate",
        action="store_true",
        help="only record results (e.g. to make a baseline); exit 0 if lm_eval ran",
    )
    p.set_defaults(func=cmd_serve_eval)

    p = _serve_subparser(sub, "serve-bench", "serve, run vllm bench serve, compare",
                         "bench_config", "bench YAML, kind: vllm_bench_serve (configs/bench/...)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FLAG=VALUE",
        help="override a bench flag, e.g. --set num-prompts=2 (repeatable)",
    )
    p.add_argument(
        "--max-regression",
        type=float,
        default=None,
        metavar="FRACTION",
        help="fail if a metric is worse than the baseline by more than this "
        "(0.05 = 5%%); default: the bench config's max_regression, else report only",
    )
    p.set_defaults(func=cmd_serve_bench)

    p = sub.add_parser("compare-eval", help="gate an existing eval result (no server)")
    p.add_argument("result", help="eval-summary.json or lm_eval results_*.json")
    p.add_argument("eval_config", help="eval YAML with the gates")
    p.add_argument("--baseline", default=None, metavar="RUN.json")
    p.set_defaults(func=cmd_compare_eval)

    p = sub.add_parser("compare-bench", help="compare two bench results (no server)")
    p.add_argument("result", help="bench-summary.json or a vllm bench serve result JSON")
    p.add_argument("--baseline", required=True, metavar="RUN.json")
    p.add_argument("--max-regression", type=float, default=None, metavar="FRACTION")
    p.set_defaults(func=cmd_compare_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``vllm-dsv4-run``; returns the exit code (see the module doc)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        with _sigterm_as_interrupt():
            return func(args)
    except ConfigError as e:
        _say(f"configuration error: {e}")
        return EXIT_CONFIG
    except RunError as e:
        _say(f"error: {e}")
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        _say("interrupted")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
