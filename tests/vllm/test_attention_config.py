# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``use_fp4_indexer_cache`` (the flag users know) through vLLM's real parser."""

import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from vllm_dsv4_backend.vllm_compat import patches  # noqa: E402
from vllm_dsv4_backend.vllm_compat.attention_config import normalize_attention_config  # noqa: E402

# The registry entries plugin.register() arms, applied now (this process loads no plugins).
CONFIG_PATCHES = ("attention_config_json", "attention_config_init", "llm_attention_config")


def install() -> None:
    for name in CONFIG_PATCHES:
        patches.apply(name)


@pytest.fixture(scope="module")
def parser():
    install()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return EngineArgs.add_cli_args(FlexibleArgumentParser())


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--attention-config", '{"use_fp4_indexer_cache":true}'], "mxfp4"),
        (["--attention-config", '{"use_fp4_indexer_cache":false}'], "fp8"),
        (["--attention-config.use_fp4_indexer_cache", "true"], "mxfp4"),
        (["--attention-config", '{"indexer_kv_dtype":"mxfp4"}'], "mxfp4"),
        (["--attention-config", '{"use_fp4_indexer_cache":true,"indexer_kv_dtype":"mxfp4"}'],
         "mxfp4"),
    ],
)
def test_cli_mapping(parser, argv, expected):
    assert parser.parse_args(argv).attention_config.indexer_kv_dtype == expected


def test_python_api_mapping():
    install()
    from vllm.config.attention import AttentionConfig

    assert AttentionConfig(use_fp4_indexer_cache=True).indexer_kv_dtype == "mxfp4"
    assert AttentionConfig(use_fp4_indexer_cache=False).indexer_kv_dtype == "fp8"
    with pytest.raises(ValueError, match="Contradictory"):
        AttentionConfig(use_fp4_indexer_cache=True, indexer_kv_dtype="fp8")


@pytest.mark.parametrize("bad", [{"use_fp4_indexer_cache": "maybe"},
                                 {"use_fp4_indexer_cache": True, "indexer_kv_dtype": "fp8"}])
def test_normalize_rejects(bad):
    with pytest.raises(ValueError, match="use_fp4_indexer_cache|Contradictory"):
        normalize_attention_config(bad)


def test_contradiction_is_a_clear_cli_error():
    # A fresh process: argparse exits 2 with our message, not a bare
    # "invalid parse_dataclass value".
    code = (
        "from vllm_dsv4_backend.vllm_compat import patches;"
        "[patches.apply(n) for n in ('attention_config_json', 'attention_config_init')];"
        "from vllm.engine.arg_utils import EngineArgs;"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser;"
        "p = EngineArgs.add_cli_args(FlexibleArgumentParser());"
        "p.parse_args(['--attention-config',"
        " '{\"use_fp4_indexer_cache\":true,\"indexer_kv_dtype\":\"fp8\"}'])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "Contradictory attention-config" in proc.stderr
