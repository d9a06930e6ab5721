# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The runner's three config files: serve (``vllm serve --config``), eval
(``kind: lm_eval``) and bench (``kind: vllm_bench_serve``), parsed and turned
into command lines (stdlib + PyYAML; imports neither vLLM nor lm_eval).

:data:`TINY_SERVE_CONFIG` is the one definition of the tiny CPU test server
(``configs/serve/tiny-dsv4-cpu.yaml``): ``scripts/serve_tiny.sh``, the tests'
``tiny_server`` and the end-to-end benchmark all serve it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_dsv4_backend.run.common import ConfigError
from vllm_dsv4_backend.run.gates import Gate, _opt_float, parse_gate

__all__ = [
    "BENCH_KIND",
    "EVAL_KIND",
    "REPO",
    "TINY_SERVE_CONFIG",
    "BenchConfig",
    "EvalConfig",
    "ServeConfig",
    "apply_overrides",
    "build_bench_command",
    "build_lm_eval_command",
    "build_serve_command",
    "load_bench_config",
    "load_eval_config",
    "load_serve_config",
    "load_yaml",
    "yaml_to_flags",
]

EVAL_KIND = "lm_eval"
BENCH_KIND = "vllm_bench_serve"

# A source checkout's configs/ (the runner is run from the repo; an installed
# wheel has no configs/ and callers pass their own paths).
REPO = Path(__file__).resolve().parents[2]
TINY_SERVE_CONFIG = REPO / "configs" / "serve" / "tiny-dsv4-cpu.yaml"

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
