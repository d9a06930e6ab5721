# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The A/B engine of the plugin-vs-vLLM benchmarks (``step-ab``, ``layer-ab``,
``e2e-layers``, ``solo-identity``): what they share, once.

* statistics of paired ratios (vLLM / plugin, >= 1: the plugin at least as good): the
  median's distribution-free 95% CI (:func:`median_ci`), the Hodges-Lehmann estimate with
  its signed-rank CI (:func:`hodges_lehmann_ci`), the verdict (:func:`verdict`) and the
  row of the four (:func:`ratio_stats`);
* one in-process vLLM engine with the plugin's layer (:func:`start_engine`), whose modules
  switch between the plugin's classes and vLLM's (:func:`swapped_parts`,
  :func:`set_classes`): ``step-ab`` and ``layer-ab``;
* both layers served at once by two ``vllm serve`` of the tiny model
  (:func:`served_layers`): ``e2e-layers`` and ``solo-identity``;
* the commands' common CLI: ``--json``, the shape flags, progress lines, and
  :func:`conclude` (run, JSON to a file, table to stdout, exit 3 naming a failure).

Every result is one JSON object whose ``schema`` names the command and its version.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from vllm_dsv4_backend.run.config import TINY_SERVE_CONFIG

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "configs" / "tiny-dsv4"
SERVE_CONFIG = TINY_SERVE_CONFIG
SIDES = ("plugin", "vllm")
# DeepSeek-V4-Flash's attention shapes (per its config); MoE/vocab stay tiny.
FLASH_ATTENTION = {
    "hidden_size": 4096, "num_attention_heads": 64, "q_lora_rank": 1024,
    "o_lora_rank": 1024, "o_groups": 8, "moe_intermediate_size": 256,
}


class E2EError(RuntimeError):
    """A server or a request to it failed (the message says which)."""


# ---------------------------------------------------------------------------------------------
# statistics of paired ratios
# ---------------------------------------------------------------------------------------------
def median_ci(xs: Sequence[float]) -> tuple[float, float]:
    """Distribution-free 95% confidence interval of the median of ``xs`` (non-empty): the
    order statistics ``x_(j)``, ``x_(k)`` (1-based) with ``j = floor(n/2 - 0.98 sqrt(n))``
    and ``k = ceil(1 + n/2 + 0.98 sqrt(n))`` (binomial, normal approximation), clamped to
    ``x_(1)`` and ``x_(n)``."""
    s = sorted(xs)
    n = len(s)
    half = 0.98 * n**0.5
    j = max(1, math.floor(n / 2 - half))
    k = min(n, math.ceil(1 + n / 2 + half))
    return s[j - 1], s[k - 1]


_EXACT_SIGNED_RANK_MAX_N = 150


def _signed_rank_cut_normal(n: int) -> int:
    """:func:`_signed_rank_cut` by the normal approximation of ``T+``."""
    return max(0, math.floor(n * (n + 1) / 4
                             - 1.96 * math.sqrt(n * (n + 1) * (2 * n + 1) / 24)))


@functools.cache  # one summary asks it for the same n once per metric
def _signed_rank_cut(n: int) -> int:
    """0-based rank of the lower 95% bound among the ``n(n+1)/2`` sorted Walsh averages: the
    largest ``t`` with ``P(T+ <= t) <= 0.025`` under the signed-rank null (exact up to
    ``n = 150``, the normal approximation above), 0 where even ``t = 0`` is too likely."""
    if n > _EXACT_SIGNED_RANK_MAX_N:
        return _signed_rank_cut_normal(n)
    top = n * (n + 1) // 2
    counts = [1] + [0] * top  # subsets of ranks 1..n by their sum
    for r in range(1, n + 1):
        for t in range(top, r - 1, -1):
            counts[t] += counts[t - r]
    cut, cum = 0, 0
    for t, c in enumerate(counts):
        cum += c
        if cum * 40 > 2**n:  # P(T+ <= t) > 0.025
            break
        cut = t
    return cut


def hodges_lehmann_ci(ratios: Sequence[float]) -> tuple[float, float, float]:
    """Hodges-Lehmann estimate of the centre of the positive ``ratios`` (non-empty) and its
    distribution-free 95% confidence interval (Wilcoxon signed rank), on their logs:
    ``(estimate, lo, hi)``.

    The estimate is exp of the median of the Walsh averages ``(y_i + y_j) / 2``, ``i <= j``,
    of ``y = log(ratios)``; the interval is exp of the sorted Walsh averages of 0-based
    rank ``k`` and ``N - 1 - k`` (``N = n(n+1)/2``, ``k``: :func:`_signed_rank_cut`), so it
    holds the centre with probability >= 95% (min..max below n = 6, where 95% is
    unreachable). Logs make a ratio and its inverse symmetric. It assumes the log ratios
    are symmetric about their centre, which paired rounds whose order alternates give;
    then it needs about 2/3 of the pairs the median needs for the same interval, and
    single outlying pairs move it as little."""
    if not ratios or any(not (isinstance(r, int | float) and 0 < r < math.inf)
                         for r in ratios):
        raise ValueError(f"ratios: expected a non-empty sequence of finite positive numbers, "
                         f"got {list(ratios)!r}")
    ys = [math.log(r) for r in ratios]
    n = len(ys)
    walsh = sorted((ys[i] + ys[j]) / 2 for i in range(n) for j in range(i, n))
    big = len(walsh)
    k = min(_signed_rank_cut(n), (big - 1) // 2)
    return (math.exp(statistics.median(walsh)), math.exp(walsh[k]),
            math.exp(walsh[big - 1 - k]))


def verdict(lo: float | None, hi: float | None) -> str:
    """``plugin`` / ``vllm`` when the ratio's interval excludes 1 that way, else ``tie``."""
    if lo is None or hi is None:
        return "n/a"
    return "plugin" if lo > 1.0 else "vllm" if hi < 1.0 else "tie"


def ratio_stats(ratios: Sequence[float]) -> dict[str, Any]:
    """``pairs``, ``ratio_median``, ``ratio_ci95_lo`` / ``_hi`` (:func:`median_ci`) and
    ``verdict`` of paired ratios (None / ``n/a`` without any)."""
    lo, hi = median_ci(ratios) if ratios else (None, None)
    return {"pairs": len(ratios), "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_ci95_lo": lo, "ratio_ci95_hi": hi, "verdict": verdict(lo, hi)}


# ---------------------------------------------------------------------------------------------
# one in-process engine, its layers switching sides
# ---------------------------------------------------------------------------------------------
def flash_shaped_model(out_dir: Path) -> Path:
    """A copy of the tiny model dir with Flash's attention widths."""
    dst = out_dir / "flash-shaped-dsv4"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(TINY_MODEL, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(FLASH_ATTENTION)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def start_engine(*, flash_shaped: bool, threads: int | None, max_model_len: int,
                 max_num_batched_tokens: int, max_num_seqs: int, **extra: Any
                 ) -> tuple[Any, int]:
    """One vLLM engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the
    bench's hooks see its model) serving the tiny model, or its Flash-shaped copy, with
    the plugin's layer: ``(llm, vocab size)``.

    ``threads`` (None: torch's default) is set before the engine starts (vLLM's CPU worker
    refuses ``torch.set_num_threads`` once it has bound its threads) and checked after: a
    figure timed at another count than asked is refused (``RuntimeError``)."""
    import torch

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be positive, got {threads}")
        torch.set_num_threads(threads)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # LLM first: the plugin patches LLM.__init__ when it loads.
    from vllm import LLM
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    model = (flash_shaped_model(Path(tempfile.mkdtemp(prefix="dsv4-ab-"))) if flash_shaped
             else TINY_MODEL)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    llm = LLM(model=str(model), load_format="dummy", tokenizer_mode="hf",
              kv_cache_dtype="fp8", enforce_eager=True, max_model_len=max_model_len,
              max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
              seed=0, attention_backend="FLASHMLA_SPARSE_DSV4", enable_prefix_caching=False,
              **extra)
    if threads is not None and torch.get_num_threads() != threads:
        raise RuntimeError(f"--threads {threads} asked, but the engine runs on "
                           f"{torch.get_num_threads()} (vLLM's CPU thread binding overrode it)")
    return llm, vocab


def token_prompts(rng: Any, vocab: int, lengths: Sequence[int]) -> list[Any]:
    """One vLLM ``TokensPrompt`` of random ids (16..vocab) per length."""
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=[rng.randrange(16, vocab) for _ in range(n)])
            for n in lengths]


def swapped_parts(layer: Any) -> list[tuple[Any, type, type]]:
    """``(module, plugin class, vLLM class)`` for the plugin's attention module
    and each submodule whose class the plugin swaps (indexer, compressors): the
    vLLM class is the first of the module's bases that vLLM defines."""
    parts = []
    indexer = getattr(layer, "indexer", None)
    for m in (layer, indexer, getattr(layer, "compressor", None),
              getattr(indexer, "compressor", None)):
        if m is not None:
            cls = type(m)
            vllm_cls = next(c for c in cls.__mro__ if c.__module__.startswith("vllm."))
            parts.append((m, cls, vllm_cls))
    return parts


def set_classes(parts: Sequence[tuple[Any, type, type]], side: str) -> None:
    """Switch ``parts`` (:func:`swapped_parts`) to the plugin's or vLLM's classes."""
    for m, plugin_cls, vllm_cls in parts:
        m.__class__ = plugin_cls if side == "plugin" else vllm_cls


# ---------------------------------------------------------------------------------------------
# both layers served
# ---------------------------------------------------------------------------------------------
def ordinary_token_ids(model_dir: Path) -> list[int]:
    """The model's token ids that are neither added nor special tokens (prompts made of
    them decode and re-encode like text)."""
    from tokenizers import Tokenizer

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = set(tok.get_added_tokens_decoder())
    vocab = min(tok.get_vocab_size(with_added_tokens=True), int(cfg["vocab_size"]))
    return [i for i in range(vocab) if i not in special]


def client_session() -> Any:
    """The aiohttp session of a bench client (10 minutes per request at most)."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))


@contextlib.contextmanager
def served_layers(kind: str, *, out_dir: str | os.PathLike[str] | None = None,
                  health_timeout: float = 1200.0, progress: TextIO | None = sys.stderr
                  ) -> Iterator[tuple[Any, Path, dict[str, Any]]]:
    """Both layers served at once from ``configs/serve/tiny-dsv4-cpu.yaml``, one server
    per ``VLLM_DSV4_ATTN_IMPL`` side, healthy on entry, stopped on exit: ``(serve config,
    run directory, servers by side)``. The run directory (``out_dir``, default
    ``$DSV4_SCRATCH/runs/<time>-<kind>``) holds the servers' logs."""
    from vllm_dsv4_backend import run as R

    serve = R.load_serve_config(SERVE_CONFIG)
    if serve.model_path is None:
        raise ValueError(f"{SERVE_CONFIG}: the model must be a local directory")
    scratch = Path(os.environ.get("DSV4_SCRATCH", REPO / ".scratch"))
    out = Path(out_dir) if out_dir else scratch / "runs" / (
        time.strftime("%Y%m%d-%H%M%S") + f"-{kind}")
    out.mkdir(parents=True, exist_ok=True)
    say = sayer(kind, progress)
    servers: dict[str, Any] = {}
    try:
        for side in SIDES:
            env = R.cpu_env(scratch, {**os.environ, "VLLM_DSV4_ATTN_IMPL": side})
            servers[side] = R.make_server(serve, log_path=out / f"server-{side}.log", env=env)
            say(f"{side}: starting vllm serve (log {servers[side].log_path})")
            servers[side].start()
        for side in SIDES:
            servers[side].wait_healthy(timeout=health_timeout, progress=progress)
        yield serve, out, servers
    finally:
        for server in servers.values():
            server.stop()


# ---------------------------------------------------------------------------------------------
# the commands' CLI
# ---------------------------------------------------------------------------------------------
def sayer(kind: str, progress: TextIO | None) -> Callable[[str], None]:
    """A progress line ``[kind] msg`` to ``progress`` (None: silent)."""
    def say(msg: str) -> None:
        if progress is not None:
            progress.write(f"[{kind}] {msg}\n")
            progress.flush()
    return say


def positive(text: str) -> int:
    """argparse type: an int >= 1."""
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text}")
    return v


def batches(text: str) -> list[int]:
    """argparse type: comma-separated positive batch sizes."""
    out = [positive(x) for x in text.split(",") if x.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected at least one batch size")
    return out


def parser(doc: str, *, context: int | None = None) -> argparse.ArgumentParser:
    """A command's parser: described by the first paragraph of ``doc``, with ``--json``
    and, for the in-process engines (given the default ``context``), ``--flash-shaped``,
    ``--batches``, ``--context``, ``--prefill`` and ``--threads``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--json", help="write the result here")
    if context is not None:
        p.add_argument("--flash-shaped", action="store_true",
                       help="DeepSeek-V4-Flash attention widths instead of the tiny model's")
        p.add_argument("--batches", type=batches, default=[1, 8, 32],
                       help="decode batch sizes (default 1,8,32)")
        p.add_argument("--context", type=positive, default=context,
                       help=f"prompt tokens per decode request (default {context})")
        p.add_argument("--prefill", type=positive, default=1024,
                       help="prompt tokens of the prefill case (default 1024)")
        p.add_argument("--threads", type=positive, default=None,
                       help="torch CPU threads of the engine (default: torch's, one per core; "
                            "a served CPU worker runs on 1 where the cores are 2)")
    return p


def finish(result: dict[str, Any], json_path: str | None, text: str) -> int:
    """A comparison's last step: the JSON result to ``json_path`` (if given), the table to
    stdout; returns exit code 0."""
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    print(text)
    return 0


def conclude(kind: str, run: Callable[[], dict[str, Any]],
             fmt: Callable[[dict[str, Any]], str], json_path: str | None) -> int:
    """Run a comparison and :func:`finish` it; a ``ValueError`` / ``RuntimeError`` (a bad
    setting, a server or engine that failed) is printed as ``<kind> failed: ...``, exit 3."""
    try:
        res = run()
    except (ValueError, RuntimeError) as e:
        print(f"{kind} failed: {e}", file=sys.stderr)
        return 3
    return finish(res, json_path, fmt(res))
