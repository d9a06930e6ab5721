# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The runner's configs and command lines against vLLM's own parsers (moved
from tests/core/test_runner_configs.py, which stays torch-only): every serve
config parses with ``vllm serve``'s parser and says what the issue asks,
bench configs parse with ``vllm bench serve``'s, the YAML -> flags expansion
equals vLLM's ``load_config_file``, and the plugin maps
``use_fp4_indexer_cache``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_dsv4_backend import run as R  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
BENCH_CONFIGS = sorted((CONFIGS / "bench").glob("*.yaml"))
FP4 = CONFIGS / "serve" / "deepseek-v4-flash-tp4-fp4idx.yaml"
FP8 = CONFIGS / "serve" / "deepseek-v4-flash-tp4-fp8idx.yaml"
TINY = R.TINY_SERVE_CONFIG


def _vllm_serve_parser():
    """The parser `vllm serve` uses (vllm/entrypoints/cli/main.py), built the same way."""
    pytest.importorskip("vllm")
    import vllm.entrypoints.cli.serve as serve_mod
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    sub = parser.add_subparsers(required=False, dest="subparser")
    for cmd in serve_mod.cmd_init():
        cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
    return parser, serve_mod


def _parse_serve(path: Path, *extra: str):
    """Parse like `vllm serve --config PATH ...` (no EngineArgs: offline, that would try
    to resolve the HF model id)."""
    parser, serve_mod = _vllm_serve_parser()
    args = parser.parse_args(["serve", "--config", str(path), *extra])
    serve_mod.ServeSubcommand().validate(args)
    return args


@pytest.mark.vllm
@pytest.mark.parametrize("path", [FP8, TINY], ids=lambda p: p.stem)
def test_serve_config_parses_with_vllm(path: Path) -> None:
    ea = _parse_serve(path, "--host", "127.0.0.1", "--port", "8123")
    raw = R.load_serve_config(path).raw
    assert ea.model == raw["model"]
    assert str(ea.attention_backend).endswith("FLASHMLA_SPARSE_DSV4") or (
        getattr(ea.attention_backend, "name", None) == "FLASHMLA_SPARSE_DSV4"
    )
    assert ea.kv_cache_dtype == "fp8"
    assert ea.tokenizer_mode == raw["tokenizer-mode"]
    assert ea.port == 8123 and ea.host == "127.0.0.1"
    if path == FP8:
        assert ea.tensor_parallel_size == 4 and ea.enable_expert_parallel is True
        assert ea.all2all_backend == "allgather_reducescatter"
        assert ea.attention_config.indexer_kv_dtype == "fp8"
    else:
        assert ea.load_format == "dummy" and ea.enforce_eager is True
        assert ea.max_model_len == 4096


@pytest.mark.vllm
def test_fp4_serve_config_parses_with_vllm_and_plugin() -> None:
    """The issue's `use_fp4_indexer_cache` spelling works only through the plugin's
    mapping (vLLM >= 0.32 rejects the key); with it, the indexer cache is MXFP4."""
    _vllm_serve_parser()  # loads the general plugins, ours included
    from vllm.engine import arg_utils

    from vllm_dsv4_backend.vllm_compat import hooks

    assert hooks.is_port(arg_utils._expand_json_human_readable_numbers), (
        "register() must install the use_fp4_indexer_cache mapping"
    )
    ea = _parse_serve(FP4)
    assert ea.tensor_parallel_size == 4 and ea.enable_expert_parallel is True
    assert ea.attention_config.indexer_kv_dtype == "mxfp4"


@pytest.mark.vllm
def test_cli_overrides_config_like_vllm_says() -> None:
    """Precedence cli > config: the runner's --host/--port and --serve-arg rely on it."""
    ea = _parse_serve(TINY, "--max-model-len", "1024")
    assert ea.max_model_len == 1024


@pytest.mark.vllm
def test_yaml_to_flags_matches_vllm_load_config_file(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cfg = {
        "num-prompts": 4,
        "ignore-eos": True,
        "temperature": 0,
        "metric-percentiles": "50,99",
        "extra-body": {"a": 1, "b": [1, 2]},
        "goodput": ["ttft:100", "tpot:20"],
    }
    p = tmp_path / "c.yaml"
    import yaml

    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert R.yaml_to_flags(cfg) == FlexibleArgumentParser().load_config_file(str(p))
    for path in BENCH_CONFIGS:
        args = R.load_bench_config(path).args
        q = tmp_path / path.name
        q.write_text(yaml.safe_dump(args, sort_keys=False))
        assert R.yaml_to_flags(args) == FlexibleArgumentParser().load_config_file(str(q))


def _bench_parse(cmd: list[str]):
    pytest.importorskip("vllm")
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert cmd[1:6] == ["-m", "vllm.entrypoints.cli.main", "bench", "serve", cmd[5]]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(cmd[5:])


@pytest.mark.vllm
@pytest.mark.parametrize("name,conc", [("decode-heavy", 1), ("throughput", 32)])
def test_bench_config_parses_with_vllm_bench(name: str, conc: int, tmp_path: Path) -> None:
    bench = R.load_bench_config(CONFIGS / "bench" / f"{name}.yaml")
    serve = R.load_serve_config(FP4)
    cmd = R.build_bench_command(
        bench, base_url="http://127.0.0.1:8123/", model_name=serve.served_model_name,
        tokenizer=serve.tokenizer, tokenizer_mode=serve.tokenizer_mode, result_dir=tmp_path,
        result_filename="r.json",
    )  # fmt: skip
    a = _bench_parse(cmd)
    assert (a.dataset_name, a.random_input_len, a.random_output_len) == ("random", 2, 2048)
    assert a.max_concurrency == conc
    assert a.num_warmups == 2 and a.ignore_eos is True
    assert a.temperature == 0.0 and a.seed == 0
    if name == "decode-heavy":
        assert a.num_prompts == 4
    assert a.save_result is True and a.result_dir == str(tmp_path)
    assert a.result_filename == "r.json"
    assert a.base_url == "http://127.0.0.1:8123"
    assert a.model == "deepseek-ai/DeepSeek-V4-Flash" and a.tokenizer_mode == "deepseek_v4"
    assert set(a.percentile_metrics.split(",")) >= {"ttft", "tpot"}
    assert "99" in a.metric_percentiles.split(",")
