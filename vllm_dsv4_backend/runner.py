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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

EXIT_PASS = 0
EXIT_GATE_FAILED = 1
EXIT_CONFIG = 2
EXIT_RUNTIME = 3
EXIT_INTERRUPTED = 130

EVAL_KIND = "lm_eval"
BENCH_KIND = "vllm_bench_serve"

_PREFIX = "[vllm-dsv4-run]"


class ConfigError(ValueError):
    """A config file or argument is malformed; the message names file and key."""


class RunError(RuntimeError):
    """The server, lm_eval or the benchmark failed; the message carries a log tail."""


# --------------------------------------------------------------------------
# YAML -> command-line flags
# --------------------------------------------------------------------------


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML mapping; anything else (missing file, list, scalar) -> ConfigError."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a YAML mapping at top level, got {type(data).__name__}")
    return data


def yaml_to_flags(cfg: Mapping[str, Any]) -> list[str]:
    """Expand ``{key: value}`` into argparse flags with vLLM's ``--config`` rules.

    Mirrors ``FlexibleArgumentParser.load_config_file`` (vLLM 0.32): ``true`` ->
    ``--key``; ``false`` -> omitted (vLLM emits ``--no-key`` only when the parser
    has it; every boolean the bench configs use is a store_true flag); a list
    -> ``--key v1 v2``; a mapping -> ``--key '<json>'``; anything else ->
    ``--key str(value)``. ``None`` is refused rather than passed as "None".
    """
    flags: list[str] = []
    for key, value in cfg.items():
        if not isinstance(key, str) or not key or key.startswith("-"):
            raise ConfigError(f"flag name must be a plain string like 'num-prompts', got {key!r}")
        if value is None:
            raise ConfigError(f"flag {key!r} has no value (null); remove it or give a value")
        if isinstance(value, bool):
            if value:
                flags.append(f"--{key}")
        elif isinstance(value, list):
            if value:
                flags.append(f"--{key}")
                flags.extend(str(v) for v in value)
        elif isinstance(value, dict):
            flags += [f"--{key}", json.dumps(value)]
        else:
            flags += [f"--{key}", str(value)]
    return flags


def _norm_key(key: str) -> str:
    return key.replace("_", "-")


def _get(cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """Look ``key`` up with vLLM's dash/underscore equivalence (``max-model-len``)."""
    for k, v in cfg.items():
        if _norm_key(str(k)) == _norm_key(key):
            return v
    return default


# --------------------------------------------------------------------------
# Serve configs
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What the runner needs to know about a ``vllm serve --config`` YAML.

    ``model_path`` is set when the config names a local directory by a path
    relative to the repo (``configs/tiny-dsv4``): vLLM would resolve it against
    the current directory, so the runner passes the absolute path as the
    positional model (vLLM gives the positional model precedence over the
    config's ``model``).
    """

    path: Path
    raw: dict[str, Any]
    model: str
    served_model_name: str
    tokenizer: str
    tokenizer_mode: str | None
    max_model_len: int | None
    model_path: Path | None

    @property
    def name(self) -> str:
        return self.path.stem


def _resolve_local(value: str, anchor: Path) -> Path | None:
    """Absolute path of ``value`` if it is an existing local path, searched
    from the current directory, then from ``anchor``'s directory upwards."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return p if p.exists() else None
    if p.exists():
        return p.resolve()
    for parent in anchor.resolve().parents:
        if (parent / p).exists():
            return (parent / p).resolve()
    return None


def load_serve_config(path: str | os.PathLike[str]) -> ServeConfig:
    """Parse a serve config; requires ``model``; refuses runner-owned keys.

    ``host``/``port`` are refused because the runner picks them (a loopback
    address and a free port) and a config value would silently lose to them.
    """
    p = Path(path)
    raw = load_yaml(p)
    model = _get(raw, "model")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{p}: key 'model' (string) is required, got {model!r}")
    for key in ("host", "port"):
        if _get(raw, key) is not None:
            raise ConfigError(
                f"{p}: key {key!r} is set by vllm-dsv4-run (--host/--port); remove it from "
                "the serve config"
            )
    model_path = _resolve_local(model, p)
    names = _get(raw, "served-model-name")
    if isinstance(names, list):
        names = names[0] if names else None
    served = str(names) if names else model
    tok = _get(raw, "tokenizer")
    if isinstance(tok, str) and tok:
        tok_path = _resolve_local(tok, p)
        tokenizer = str(tok_path) if tok_path else tok
    else:
        tokenizer = str(model_path) if model_path else model
    mml = _get(raw, "max-model-len")
    if mml is not None and not isinstance(mml, int):
        raise ConfigError(f"{p}: 'max-model-len' must be an integer, got {mml!r}")
    return ServeConfig(
        path=p,
        raw=raw,
        model=model,
        served_model_name=served,
        tokenizer=tokenizer,
        tokenizer_mode=_get(raw, "tokenizer-mode"),
        max_model_len=mml,
        model_path=model_path if model_path and model_path.is_dir() else None,
    )


def build_serve_command(
    serve: ServeConfig,
    *,
    host: str,
    port: int,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """``python -m vllm.entrypoints.cli.main serve [MODEL] --config SERVE.yaml ...``.

    The module form (not the ``vllm`` script) pins the interpreter, so the
    server runs in the same environment as the runner. Flags after ``--config``
    override the config (vLLM's precedence: CLI > config > defaults).
    """
    cmd = [python, "-m", "vllm.entrypoints.cli.main", "serve"]
    if serve.model_path is not None:
        cmd.append(str(serve.model_path))
    cmd += ["--config", str(serve.path), "--host", host, "--port", str(port)]
    cmd += list(extra_args)
    return cmd


# --------------------------------------------------------------------------
# Eval configs and gates
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Gate:
    """One pass/fail rule on one lm_eval metric.

    The score passes when ``baseline - tol <= score`` (and ``score <=
    baseline + tol`` if ``two_sided``), with ``tol = abs_tol`` if given, else
    ``k_stderr * stderr``. ``baseline``/``stderr`` come from the config or,
    with ``--baseline RUN.json``, from that run's lm_eval results for the same
    task and metric.
    """

    task: str
    metric: str
    filter: str = "none"
    baseline: float | None = None
    stderr: float | None = None
    k_stderr: float = 2.0
    abs_tol: float | None = None
    two_sided: bool = False

    @property
    def key(self) -> str:
        """lm_eval's results key, e.g. ``exact_match,flexible-extract``."""
        return f"{self.metric},{self.filter}"

    @property
    def stderr_key(self) -> str:
        return f"{self.metric}_stderr,{self.filter}"


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """An lm_eval run (``kind: lm_eval``) plus its gates."""

    path: Path
    tasks: tuple[str, ...]
    include_path: Path | None
    num_fewshot: int | None
    limit: int | float | None
    seed: int
    batch_size: int
    apply_chat_template: bool
    log_samples: bool
    model_args: dict[str, Any]
    gen_kwargs: dict[str, Any] | None
    gates: tuple[Gate, ...]

    @property
    def name(self) -> str:
        return self.path.stem


_GATE_KEYS = {f.name for f in dataclasses.fields(Gate)}
_EVAL_KEYS = {
    "kind",
    "description",
    "tasks",
    "include_path",
    "num_fewshot",
    "limit",
    "seed",
    "batch_size",
    "apply_chat_template",
    "log_samples",
    "model_args",
    "gen_kwargs",
    "gates",
}


def _opt_float(where: str, v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ConfigError(f"{where}: expected a finite number, got {v!r}")
    return float(v)


def parse_gate(where: str, d: Any) -> Gate:
    """Validate one ``gates:`` entry (``where`` names it in errors)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping, got {d!r}")
    unknown = set(d) - _GATE_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed {sorted(_GATE_KEYS)}")
    for req in ("task", "metric"):
        if not isinstance(d.get(req), str) or not d[req]:
            raise ConfigError(f"{where}: {req!r} (string) is required")
    gate = Gate(
        task=d["task"],
        metric=d["metric"],
        filter=str(d.get("filter", "none")),
        baseline=_opt_float(f"{where}.baseline", d.get("baseline")),
        stderr=_opt_float(f"{where}.stderr", d.get("stderr")),
        k_stderr=_opt_float(f"{where}.k_stderr", d.get("k_stderr", 2.0)) or 0.0,
        abs_tol=_opt_float(f"{where}.abs_tol", d.get("abs_tol")),
        two_sided=bool(d.get("two_sided", False)),
    )
    if gate.k_stderr < 0 or (gate.abs_tol is not None and gate.abs_tol < 0):
        raise ConfigError(f"{where}: k_stderr and abs_tol must be >= 0")
    if gate.stderr is not None and gate.stderr < 0:
        raise ConfigError(f"{where}: stderr must be >= 0, got {gate.stderr}")
    return gate


def load_eval_config(path: str | os.PathLike[str]) -> EvalConfig:
    """Parse and validate an eval config (``kind: lm_eval``)."""
    p = Path(path)
    d = load_yaml(p)
    if d.get("kind") != EVAL_KIND:
        raise ConfigError(f"{p}: expected 'kind: {EVAL_KIND}', got kind={d.get('kind')!r}")
    unknown = set(d) - _EVAL_KEYS
    if unknown:
        raise ConfigError(f"{p}: unknown keys {sorted(unknown)}; allowed {sorted(_EVAL_KEYS)}")
    tasks = d.get("tasks")
    if isinstance(tasks, str):
        tasks = [tasks]
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) for t in tasks):
        raise ConfigError(f"{p}: 'tasks' must be a non-empty list of task names, got {tasks!r}")
    include = d.get("include_path")
    include_path = None
    if include is not None:
        include_path = (p.parent / include).resolve()
        if not include_path.is_dir():
            raise ConfigError(
                f"{p}: include_path {include!r} (relative to the config) is not a directory"
            )
    model_args = d.get("model_args") or {}
    if not isinstance(model_args, dict):
        raise ConfigError(f"{p}: 'model_args' must be a mapping, got {model_args!r}")
    for reserved in ("model", "base_url"):
        if reserved in model_args:
            raise ConfigError(f"{p}: model_args.{reserved} is set by the runner; remove it")
    gen_kwargs = d.get("gen_kwargs")
    if gen_kwargs is not None and not isinstance(gen_kwargs, dict):
        raise ConfigError(f"{p}: 'gen_kwargs' must be a mapping, got {gen_kwargs!r}")
    gates_raw = d.get("gates") or []
    if not isinstance(gates_raw, list):
        raise ConfigError(f"{p}: 'gates' must be a list, got {gates_raw!r}")
    gates = tuple(parse_gate(f"{p}: gates[{i}]", g) for i, g in enumerate(gates_raw))
    for g in gates:
        if g.task not in tasks:
            raise ConfigError(f"{p}: gate on task {g.task!r}, which is not in tasks {tasks}")
    nf = d.get("num_fewshot")
    if nf is not None and (not isinstance(nf, int) or nf < 0):
        raise ConfigError(f"{p}: 'num_fewshot' must be an integer >= 0, got {nf!r}")
    limit = d.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int | float)):
        raise ConfigError(f"{p}: 'limit' must be a number, got {limit!r}")
    return EvalConfig(
        path=p,
        tasks=tuple(tasks),
        include_path=include_path,
        num_fewshot=nf,
        limit=limit,
        seed=int(d.get("seed", 0)),
        batch_size=int(d.get("batch_size", 1)),
        apply_chat_template=bool(d.get("apply_chat_template", False)),
        log_samples=bool(d.get("log_samples", True)),
        model_args=dict(model_args),
        gen_kwargs=gen_kwargs,
        gates=gates,
    )


def build_lm_eval_command(
    ev: EvalConfig,
    *,
    base_url: str,
    model_name: str,
    tokenizer: str | None,
    output_path: str | os.PathLike[str],
    limit: int | float | None = None,
    python: str = sys.executable,
) -> list[str]:
    """``python -m lm_eval run --model local-completions ...`` for server ``base_url``.

    ``model_args`` goes as one JSON object (lm_eval 0.4.13 accepts JSON), so
    values may contain commas. The config's ``model_args`` override the
    defaults (``tokenizer``, ``tokenizer_backend=huggingface``,
    ``tokenized_requests=False``); ``limit`` overrides the config's limit.
    """
    model_args: dict[str, Any] = {
        "model": model_name,
        "base_url": base_url.rstrip("/") + "/v1/completions",
        "tokenizer_backend": "huggingface",
        "tokenized_requests": False,
    }
    if tokenizer:
        model_args["tokenizer"] = tokenizer
    model_args.update(ev.model_args)
    if str(model_args.get("tokenizer_backend")).lower() in ("none", "remote"):
        model_args.pop("tokenizer", None)
    cmd = [python, "-m", "lm_eval", "run", "--model", "local-completions"]
    cmd += ["--model_args", json.dumps(model_args, sort_keys=True)]
    cmd += ["--tasks", ",".join(ev.tasks)]
    if ev.include_path is not None:
        cmd += ["--include_path", str(ev.include_path)]
    if ev.num_fewshot is not None:
        cmd += ["--num_fewshot", str(ev.num_fewshot)]
    lim = limit if limit is not None else ev.limit
    if lim is not None:
        # lm_eval reads "3.0" as a count but prints it oddly; keep whole counts integral
        whole = float(lim).is_integer() and lim >= 1
        cmd += ["--limit", str(int(lim)) if whole else str(lim)]
    cmd += ["--batch_size", str(ev.batch_size), "--seed", str(ev.seed)]
    if ev.gen_kwargs:
        cmd += ["--gen_kwargs", json.dumps(ev.gen_kwargs, sort_keys=True)]
    if ev.apply_chat_template:
        cmd.append("--apply_chat_template")
    cmd += ["--output_path", str(output_path)]
    if ev.log_samples:
        cmd.append("--log_samples")
    return cmd


@dataclasses.dataclass(frozen=True)
class GateResult:
    """The verdict of one gate; ``lower``/``upper`` are the accepted range."""

    gate: Gate
    score: float | None
    score_stderr: float | None
    baseline: float | None
    stderr: float | None
    lower: float | None
    upper: float | None
    passed: bool | None  # None: not evaluated (no baseline)
    baseline_source: str
    message: str = ""

    @property
    def ratio(self) -> float | None:
        if self.score is None or not self.baseline:
            return None
        return self.score / self.baseline

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ratio"] = self.ratio
        return d


def task_results(data: Mapping[str, Any], where: str = "results") -> dict[str, Any]:
    """The ``results`` table of an lm_eval results JSON or a runner eval summary."""
    res = data.get("results")
    if not isinstance(res, dict):
        raise ConfigError(f"{where}: no 'results' table (not an lm_eval or runner eval JSON)")
    return res


def metric_value(results: Mapping[str, Any], task: str, key: str) -> float | None:
    """``results[task][key]`` as float, ``None`` if missing or ``"N/A"``."""
    v = results.get(task, {}).get(key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def evaluate_gate(
    gate: Gate,
    results: Mapping[str, Any],
    baseline_results: Mapping[str, Any] | None = None,
    baseline_name: str = "baseline run",
) -> GateResult:
    """Check ``results`` (lm_eval ``results`` table) against ``gate``.

    With ``baseline_results`` the baseline value and its stderr come from that
    table (same task and key); otherwise from the gate's config. A missing
    score fails the gate (the harness did not produce the metric); a missing
    baseline leaves it unevaluated (``passed=None``).
    """
    score = metric_value(results, gate.task, gate.key)
    score_se = metric_value(results, gate.task, gate.stderr_key)
    if baseline_results is not None:
        base = metric_value(baseline_results, gate.task, gate.key)
        se = metric_value(baseline_results, gate.task, gate.stderr_key)
        source = baseline_name
        if base is None:
            return GateResult(
                gate,
                score,
                score_se,
                None,
                se,
                None,
                None,
                None,
                source,
                f"{baseline_name} has no {gate.task}/{gate.key}",
            )
    else:
        base, se, source = gate.baseline, gate.stderr, "config"
        if base is None:
            return GateResult(
                gate,
                score,
                score_se,
                None,
                se,
                None,
                None,
                None,
                source,
                "no baseline in the config; pass --baseline RUN.json",
            )
    if gate.abs_tol is not None:
        tol, how = gate.abs_tol, f"abs_tol {gate.abs_tol:g}"
    elif se is not None:
        tol, how = gate.k_stderr * se, f"{gate.k_stderr:g} x stderr {se:.4g}"
    else:
        raise ConfigError(
            f"gate {gate.task}/{gate.key}: needs abs_tol or a stderr (none in the {source})"
        )
    lower = base - tol
    upper = base + tol if gate.two_sided else None
    if score is None:
        return GateResult(
            gate,
            None,
            None,
            base,
            se,
            lower,
            upper,
            False,
            source,
            f"results have no {gate.task}/{gate.key}",
        )
    # The epsilon keeps an exact-equality gate (tol 0) robust to JSON float round trips.
    eps = 1e-12
    ok = score >= lower - eps and (upper is None or score <= upper + eps)
    rng = f"[{lower:.4f}, {upper:.4f}]" if upper is not None else f">= {lower:.4f}"
    return GateResult(
        gate, score, score_se, base, se, lower, upper, ok, source, f"{how}; accepted {rng}"
    )


def format_gate_table(rows: Sequence[GateResult]) -> str:
    """A fixed-width table: task, metric, score, baseline, ratio, range, verdict."""
    head = f"{'task':<22} {'metric':<30} {'score':>8} {'baseline':>9} {'ratio':>7}  verdict"
    lines = [head, "-" * len(head)]
    for r in rows:
        score = "n/a" if r.score is None else f"{r.score:.4f}"
        base = "n/a" if r.baseline is None else f"{r.baseline:.4f}"
        ratio = "n/a" if r.ratio is None else f"{r.ratio:.3f}"
        verdict = {True: "PASS", False: "FAIL", None: "NOT GATED"}[r.passed]
        lines.append(
            f"{r.gate.task:<22} {r.gate.key:<30} {score:>8} {base:>9} {ratio:>7}  "
            f"{verdict} ({r.message}; baseline from {r.baseline_source})"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Bench configs and comparison
# --------------------------------------------------------------------------

# (result key, higher is better)
BENCH_METRICS: tuple[tuple[str, bool], ...] = (
    ("mean_ttft_ms", False),
    ("p99_ttft_ms", False),
    ("mean_tpot_ms", False),
    ("p99_tpot_ms", False),
    ("output_throughput", True),
    ("request_throughput", True),
    ("total_token_throughput", True),
)

# Set by the runner from the serve config and its own output layout.
_BENCH_RESERVED = {
    "base-url",
    "host",
    "port",
    "model",
    "served-model-name",
    "save-result",
    "result-dir",
    "result-filename",
    "append-result",
}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """A ``vllm bench serve`` run (``kind: vllm_bench_serve``)."""

    path: Path
    args: dict[str, Any]
    max_regression: float | None

    @property
    def name(self) -> str:
        return self.path.stem


def load_bench_config(path: str | os.PathLike[str]) -> BenchConfig:
    """Parse a bench config; refuses flags the runner owns (url, model, result files)."""
    p = Path(path)
    d = load_yaml(p)
    if d.get("kind") != BENCH_KIND:
        raise ConfigError(f"{p}: expected 'kind: {BENCH_KIND}', got kind={d.get('kind')!r}")
    unknown = set(d) - {"kind", "description", "args", "max_regression"}
    if unknown:
        raise ConfigError(f"{p}: unknown keys {sorted(unknown)}")
    args = d.get("args")
    if not isinstance(args, dict) or not args:
        raise ConfigError(f"{p}: 'args' must be a non-empty mapping of `vllm bench serve` flags")
    owned = {_norm_key(k) for k in args} & _BENCH_RESERVED
    if owned:
        raise ConfigError(f"{p}: args {sorted(owned)} are set by vllm-dsv4-run; remove them")
    yaml_to_flags(args)  # validates values early
    mr = _opt_float(f"{p}: max_regression", d.get("max_regression"))
    if mr is not None and mr < 0:
        raise ConfigError(f"{p}: max_regression must be >= 0, got {mr}")
    return BenchConfig(path=p, args=dict(args), max_regression=mr)


def apply_overrides(args: Mapping[str, Any], sets: Sequence[str]) -> dict[str, Any]:
    """Apply ``--set key=value`` overrides (values parsed as YAML scalars)."""
    import yaml

    out = {_norm_key(k): v for k, v in args.items()}
    for item in sets:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        k = _norm_key(k.strip().lstrip("-"))
        if k in _BENCH_RESERVED:
            raise ConfigError(f"--set {k}: set by vllm-dsv4-run, cannot be overridden")
        out[k] = yaml.safe_load(v) if v else ""
    return out


def build_bench_command(
    bench: BenchConfig,
    *,
    base_url: str,
    model_name: str,
    tokenizer: str,
    tokenizer_mode: str | None,
    result_dir: str | os.PathLike[str],
    result_filename: str,
    overrides: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """``python -m vllm.entrypoints.cli.main bench serve <flags> --save-result ...``."""
    args = apply_overrides(bench.args, overrides)
    if tokenizer_mode and "tokenizer-mode" not in args:
        args["tokenizer-mode"] = tokenizer_mode
    cmd = [python, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    cmd += yaml_to_flags(args)
    cmd += ["--base-url", base_url.rstrip("/"), "--model", model_name, "--tokenizer", tokenizer]
    cmd += ["--save-result", "--result-dir", str(result_dir), "--result-filename", result_filename]
    return cmd


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One metric of a bench comparison; ``regression`` > 0 means worse."""

    metric: str
    higher_is_better: bool
    baseline: float | None
    new: float | None

    @property
    def ratio(self) -> float | None:
        """new / baseline."""
        if self.baseline is None or self.new is None or self.baseline == 0:
            return None
        return self.new / self.baseline

    @property
    def regression(self) -> float | None:
        """Fraction by which ``new`` is worse than the baseline (negative: better)."""
        r = self.ratio
        if r is None:
            return None
        if self.higher_is_better:
            return math.inf if r == 0 else 1.0 / r - 1.0
        return r - 1.0


def bench_result(data: Mapping[str, Any]) -> dict[str, Any]:
    """The raw ``vllm bench serve`` result inside a runner summary, or ``data`` itself."""
    if data.get("kind") == "bench" and isinstance(data.get("result"), dict):
        return dict(data["result"])
    return dict(data)


def compare_bench(
    new: Mapping[str, Any],
    baseline: Mapping[str, Any],
    metrics: Sequence[tuple[str, bool]] = BENCH_METRICS,
) -> list[BenchRow]:
    """Rows for ``metrics`` present in either result (missing values -> None)."""
    rows = []
    for key, hib in metrics:
        b, n = baseline.get(key), new.get(key)
        b = float(b) if isinstance(b, int | float) and not isinstance(b, bool) else None
        n = float(n) if isinstance(n, int | float) and not isinstance(n, bool) else None
        if b is None and n is None:
            continue
        rows.append(BenchRow(key, hib, b, n))
    return rows


def bench_gate(rows: Sequence[BenchRow], max_regression: float | None) -> tuple[bool, list[str]]:
    """(passed, reasons): every row within ``max_regression``; a missing value fails."""
    if max_regression is None:
        return True, []
    bad = []
    for r in rows:
        reg = r.regression
        if reg is None:
            bad.append(f"{r.metric}: missing in {'baseline' if r.baseline is None else 'new'}")
        elif reg > max_regression:
            bad.append(f"{r.metric}: {reg * 100:+.1f}% worse (limit {max_regression * 100:.1f}%)")
    return not bad, bad


def format_bench_table(rows: Sequence[BenchRow]) -> str:
    """Fixed-width table: metric, baseline, new, new/baseline, change (+ = worse)."""
    head = f"{'metric':<24} {'baseline':>12} {'new':>12} {'new/base':>9} {'worse by':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        b = "n/a" if r.baseline is None else f"{r.baseline:.3f}"
        n = "n/a" if r.new is None else f"{r.new:.3f}"
        ratio = "n/a" if r.ratio is None else f"{r.ratio:.3f}"
        reg = "n/a" if r.regression is None else f"{r.regression * 100:+.1f}%"
        lines.append(f"{r.metric:<24} {b:>12} {n:>12} {ratio:>9} {reg:>9}")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Server process
# --------------------------------------------------------------------------


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` (racy by nature; good enough locally)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def tail(path: str | os.PathLike[str], n: int = 40) -> str:
    """The last ``n`` lines of a text file ('' if it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except FileNotFoundError:
        return ""


class ServerProcess:
    """A ``vllm serve`` subprocess with its log file; a context manager that always stops it.

    The server runs in its own session (process group), so Ctrl-C in the
    terminal reaches only the runner, which then stops the whole group
    (API server, engine core, workers) with SIGTERM, then SIGKILL.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        host: str,
        port: int,
        log_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        self.cmd = list(cmd)
        self.host, self.port = host, port
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self.started_at = 0.0
        self.healthy_after_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        """Launch the server (non-blocking)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log.write(f"$ {shlex.join(self.cmd)}\n".encode())
        self._log.flush()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
        )
        return self

    def is_healthy(self) -> bool:
        """One ``GET /health`` with a short timeout."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_healthy(
        self,
        timeout: float = 600.0,
        progress: TextIO | None = None,
        interval: float = 0.5,
    ) -> float:
        """Block until ``/health`` answers 200; returns the seconds it took.

        Raises RunError with the log tail if the process exits first or
        ``timeout`` passes. ``progress`` gets a status line (rewritten in place
        on a TTY, one line every 10 s otherwise).
        """
        if self.proc is None:
            raise RunError("server not started")
        tty = bool(progress is not None and getattr(progress, "isatty", lambda: False)())
        cr, nl = ("\r", "") if tty else ("", "\n")
        last_print = -math.inf
        while True:
            waited = time.monotonic() - self.started_at
            rc = self.proc.poll()
            if rc is not None:
                if progress is not None and tty:
                    progress.write("\n")
                raise RunError(
                    f"vLLM server exited with code {rc} after {waited:.0f} s before /health "
                    f"answered.\ncommand: {shlex.join(self.cmd)}\nlog: {self.log_path}\n"
                    f"--- last lines ---\n{tail(self.log_path)}"
                )
            if self.is_healthy():
                self.healthy_after_s = waited
                if progress is not None:
                    progress.write(
                        f"{cr}{_PREFIX} server healthy at {self.base_url} after {waited:.0f} s\n"
                    )
                    progress.flush()
                return waited
            if waited > timeout:
                if progress is not None and tty:
                    progress.write("\n")
                raise RunError(
                    f"vLLM server did not answer {self.base_url}/health within {timeout:.0f} s."
                    f"\ncommand: {shlex.join(self.cmd)}\nlog: {self.log_path}\n"
                    f"--- last lines ---\n{tail(self.log_path)}"
                )
            if progress is not None and (tty or waited - last_print >= 10):
                last_print = waited
                progress.write(
                    f"{cr}{_PREFIX} waiting for {self.base_url}/health: "
                    f"{waited:.0f} s / {timeout:.0f} s (log: {self.log_path})"
                    f"{nl}"
                )
                progress.flush()
            time.sleep(interval)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL after ``timeout``; returns its exit code."""
        rc = None
        if self.proc is not None:
            rc = self.proc.poll()
            if rc is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    rc = self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    rc = self.proc.wait(timeout=30)
            # Children (engine core) may outlive a crashed API server: sweep the group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        return rc

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cpu_env(
    scratch: str | os.PathLike[str], base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``base`` (default ``os.environ``) plus ``scripts/env.sh``'s CPU defaults.

    Offline Hub/datasets, a 1 GiB CPU KV cache, and ``TMPDIR`` /
    ``VLLM_CACHE_ROOT`` under ``scratch`` (each engine start leaves IPC sockets
    and compile caches there). Values already set win, as in env.sh.
    """
    env = dict(os.environ if base is None else base)
    s = Path(scratch)
    defaults = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "DSV4_SCRATCH": str(s),
        "TMPDIR": str(s / "tmp"),
        "VLLM_CACHE_ROOT": str(s / "cache" / "vllm"),
    }
    for k, v in defaults.items():
        env.setdefault(k, v)
    Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    Path(env["VLLM_CACHE_ROOT"]).mkdir(parents=True, exist_ok=True)
    return env


def make_server(
    serve_config: str | os.PathLike[str] | ServeConfig,
    *,
    log_path: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int | None = None,
) -> ServerProcess:
    """A (not yet started) ServerProcess for a serve config on a free loopback port.

    Start several with ``.start()`` before waiting on any, so their slow
    imports overlap.
    """
    serve = (
        serve_config if isinstance(serve_config, ServeConfig) else load_serve_config(serve_config)
    )
    port = port or find_free_port(host)
    cmd = build_serve_command(serve, host=host, port=port, extra_args=extra_args)
    return ServerProcess(cmd, host=host, port=port, log_path=log_path, env=env)


# --------------------------------------------------------------------------
# Running things
# --------------------------------------------------------------------------


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
    print(f"{_PREFIX} {msg}", file=sys.stderr, flush=True)


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


@contextlib.contextmanager
def served(
    serve: ServeConfig,
    args: argparse.Namespace,
    out_dir: Path,
    env: dict[str, str],
    commands: dict[str, str],
) -> Iterator[str]:
    """Yield a base URL: ``--base-url`` as given, or a fresh server that is stopped after."""
    if args.base_url:
        _say(f"using the running server at {args.base_url} (not starting one)")
        yield args.base_url.rstrip("/")
        return
    port = args.port or find_free_port(args.host)
    cmd = build_serve_command(serve, host=args.host, port=port, extra_args=args.serve_arg)
    commands["serve"] = shlex.join(cmd)
    server = ServerProcess(cmd, host=args.host, port=port, log_path=out_dir / "server.log", env=env)
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


def gate_eval(
    ev: EvalConfig,
    results: Mapping[str, Any],
    baseline: Mapping[str, Any] | None,
    baseline_name: str,
) -> list[GateResult]:
    """Evaluate every gate of ``ev`` on an lm_eval ``results`` table."""
    base_table = task_results(baseline, baseline_name) if baseline is not None else None
    return [evaluate_gate(g, results, base_table, baseline_name) for g in ev.gates]


def _check_gates_evaluable(ev: EvalConfig, baseline: Mapping[str, Any] | None) -> None:
    if baseline is None:
        missing = [f"{g.task}/{g.key}" for g in ev.gates if g.baseline is None]
        if missing:
            raise ConfigError(
                f"{ev.path}: gates {missing} have no baseline in the config; pass "
                "--baseline RUN.json (e.g. a run with VLLM_DSV4_ATTN_IMPL=vllm) or --no-gate"
            )


def _verdict(rows: Sequence[GateResult]) -> int:
    if any(r.passed is False for r in rows):
        return EXIT_GATE_FAILED
    return EXIT_PASS


def cmd_serve_eval(args: argparse.Namespace) -> int:
    serve = load_serve_config(args.serve_config)
    ev = load_eval_config(args.eval_config)
    baseline = _load_baseline(args.baseline)
    if not args.no_gate:
        _check_gates_evaluable(ev, baseline)
    out_dir = Path(args.out_dir) if args.out_dir else default_out_dir(serve.name, ev.name)
    env = _common_env(args)
    commands: dict[str, str] = {}
    lm_out = out_dir / "lm_eval"
    if args.dry_run:
        url = args.base_url or f"http://{args.host}:{args.port or 8000}"
        if not args.base_url:
            print(
                shlex.join(
                    build_serve_command(
                        serve, host=args.host, port=args.port or 8000, extra_args=args.serve_arg
                    )
                )
            )
        print(
            shlex.join(
                build_lm_eval_command(
                    ev,
                    base_url=url,
                    model_name=serve.served_model_name,
                    tokenizer=serve.tokenizer,
                    output_path=lm_out,
                    limit=args.limit,
                )
            )
        )
        return EXIT_PASS
    out_dir.mkdir(parents=True, exist_ok=True)
    _say(f"results go to {out_dir}")
    t0 = time.monotonic()
    with served(serve, args, out_dir, env, commands) as url:
        cmd = build_lm_eval_command(
            ev,
            base_url=url,
            model_name=serve.served_model_name,
            tokenizer=serve.tokenizer,
            output_path=lm_out,
            limit=args.limit,
        )
        commands["lm_eval"] = shlex.join(cmd)
        _say(f"running lm_eval (log: {out_dir / 'lm_eval.log'})")
        run_logged(cmd, out_dir / "lm_eval.log", env, "lm_eval")
    res_path = find_lm_eval_results(lm_out)
    lm = json.loads(res_path.read_text())
    rows = [] if args.no_gate else gate_eval(ev, lm["results"], baseline, str(args.baseline))
    code = _verdict(rows)
    summary = {
        "kind": "eval",
        "serve_config": str(serve.path),
        "eval_config": str(ev.path),
        "served_model_name": serve.served_model_name,
        "env": {k: v for k, v in parse_env_pairs(args.env).items()},
        "commands": commands,
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
    env = _common_env(args)
    commands: dict[str, str] = {}
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

    if args.dry_run:
        url = args.base_url or f"http://{args.host}:{args.port or 8000}"
        if not args.base_url:
            print(
                shlex.join(
                    build_serve_command(
                        serve, host=args.host, port=args.port or 8000, extra_args=args.serve_arg
                    )
                )
            )
        print(shlex.join(bench_cmd(url)))
        return EXIT_PASS
    out_dir.mkdir(parents=True, exist_ok=True)
    _say(f"results go to {out_dir}")
    t0 = time.monotonic()
    with served(serve, args, out_dir, env, commands) as url:
        cmd = bench_cmd(url)
        commands["bench"] = shlex.join(cmd)
        _say(f"running vllm bench serve (log: {out_dir / 'bench.log'})")
        run_logged(cmd, out_dir / "bench.log", env, "vllm bench serve")
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
            "commands": commands,
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


def cmd_compare_eval(args: argparse.Namespace) -> int:
    ev = load_eval_config(args.eval_config)
    data = _load_baseline(args.result)
    assert data is not None
    baseline = _load_baseline(args.baseline)
    _check_gates_evaluable(ev, baseline)
    rows = gate_eval(ev, task_results(data, args.result), baseline, str(args.baseline))
    print(format_gate_table(rows))
    code = _verdict(rows)
    _say("PASS" if code == EXIT_PASS else "FAIL: a gate is outside its accepted range")
    return code


def cmd_compare_bench(args: argparse.Namespace) -> int:
    data = _load_baseline(args.result)
    baseline = _load_baseline(args.baseline)
    assert data is not None
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

    p = sub.add_parser(
        "serve-eval",
        help="serve, run lm_eval, check the gates",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    p.add_argument("serve_config", help="vllm serve --config YAML (configs/serve/...)")
    p.add_argument("eval_config", help="eval YAML, kind: lm_eval (configs/lm_eval/...)")
    _add_server_args(p)
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

    p = sub.add_parser(
        "serve-bench",
        help="serve, run vllm bench serve, compare",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    p.add_argument("serve_config", help="vllm serve --config YAML (configs/serve/...)")
    p.add_argument("bench_config", help="bench YAML, kind: vllm_bench_serve (configs/bench/...)")
    _add_server_args(p)
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
