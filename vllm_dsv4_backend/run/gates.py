# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pass/fail decisions of the runner: lm_eval gates against a config or a
baseline run, and ``vllm bench serve`` comparisons (stdlib only)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_dsv4_backend.run.common import EXIT_GATE_FAILED, EXIT_PASS, ConfigError

__all__ = [
    "BENCH_METRICS",
    "BenchRow",
    "Gate",
    "GateResult",
    "bench_gate",
    "bench_result",
    "compare_bench",
    "evaluate_gate",
    "format_bench_table",
    "format_gate_table",
    "gate_eval",
    "metric_value",
    "parse_gate",
    "task_results",
    "verdict",
]

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


_GATE_KEYS = {f.name for f in dataclasses.fields(Gate)}


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
        missing = f"{baseline_name} has no {gate.task}/{gate.key}"
    else:
        base, se, source = gate.baseline, gate.stderr, "config"
        missing = "no baseline in the config; pass --baseline RUN.json"
    if base is None:
        # Not evaluated: no range, no verdict.
        return GateResult(gate, score, score_se, None, se, None, None, None, source, missing)
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


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def format_gate_table(rows: Sequence[GateResult]) -> str:
    """A fixed-width table: task, metric, score, baseline, ratio, range, verdict."""
    head = f"{'task':<22} {'metric':<30} {'score':>8} {'baseline':>9} {'ratio':>7}  verdict"
    lines = [head, "-" * len(head)]
    for r in rows:
        score, base, ratio = _fmt(r.score, ".4f"), _fmt(r.baseline, ".4f"), _fmt(r.ratio, ".3f")
        verdict = {True: "PASS", False: "FAIL", None: "NOT GATED"}[r.passed]
        lines.append(
            f"{r.gate.task:<22} {r.gate.key:<30} {score:>8} {base:>9} {ratio:>7}  "
            f"{verdict} ({r.message}; baseline from {r.baseline_source})"
        )
    return "\n".join(lines)


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
        b, n, ratio = _fmt(r.baseline, ".3f"), _fmt(r.new, ".3f"), _fmt(r.ratio, ".3f")
        reg = "n/a" if r.regression is None else f"{r.regression * 100:+.1f}%"
        lines.append(f"{r.metric:<24} {b:>12} {n:>12} {ratio:>9} {reg:>9}")
    return "\n".join(lines)


def gate_eval(
    gates: Sequence[Gate],
    results: Mapping[str, Any],
    baseline: Mapping[str, Any] | None,
    baseline_name: str,
) -> list[GateResult]:
    """Evaluate every gate (an ``EvalConfig``'s ``gates``) on an lm_eval ``results`` table."""
    base_table = task_results(baseline, baseline_name) if baseline is not None else None
    return [evaluate_gate(g, results, base_table, baseline_name) for g in gates]


def verdict(rows: Sequence[GateResult]) -> int:
    """``EXIT_GATE_FAILED`` if any gate failed, else ``EXIT_PASS``."""
    if any(r.passed is False for r in rows):
        return EXIT_GATE_FAILED
    return EXIT_PASS
