# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``use_fp4_indexer_cache`` through vLLM 0.33's own argument parser.

vLLM 0.33 has no such field (``AttentionConfig(use_fp4_indexer_cache=True)``
is a pydantic "Unexpected keyword argument"); the plugin maps it to
``indexer_kv_dtype="mxfp4"`` before vLLM validates. The parser is built the
way ``vllm serve`` builds it (``make_arg_parser``, whose
``AsyncEngineArgs.add_cli_args`` loads the general plugins, i.e. this
package's entry point, before parsing), in a fresh process with
``VLLM_TARGET_DEVICE=cpu``: the CLI JSON and dotted forms, ``--config``
YAML, ``LLM(attention_config=...)`` and a contradiction.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.cuda_guard import require_vllm_cuda

require_vllm_cuda()

SCRIPT = textwrap.dedent(r'''
    import json, sys
    out = {}
    # LLM first: the plugin maps LLM(attention_config={...}) where the LLM
    # module was imported before the plugins were loaded (see
    # attention_config.install_llm_hook).
    import vllm.entrypoints.llm as llm_mod
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.config.attention import AttentionConfig
    try:
        AttentionConfig(use_fp4_indexer_cache=True)
        out["vllm_alone"] = "accepted"
    except Exception as e:
        out["vllm_alone"] = type(e).__name__ + ": " + str(e)
    parser = make_arg_parser(FlexibleArgumentParser())   # loads the plugins, as vllm serve
    import vllm_dsv4_backend.plugin as plugin
    out["registered"] = plugin._REGISTERED
    cases = {
        "json_true": ["--attention-config", '{"use_fp4_indexer_cache":true}'],
        "json_false": ["--attention-config", '{"use_fp4_indexer_cache":false}'],
        "dotted": ["--attention-config.use_fp4_indexer_cache", "true"],
        "yaml": ["--config", sys.argv[1]],
        "native": ["--attention-config", '{"indexer_kv_dtype":"mxfp4"}'],
    }
    for name, argv in cases.items():
        out[name] = parser.parse_args(argv).attention_config.indexer_kv_dtype
    out["python"] = AttentionConfig(use_fp4_indexer_cache=True).indexer_kv_dtype

    # LLM(attention_config={...}): stop when LLM builds its EngineArgs.
    class Stop(Exception):
        pass
    class Capture(llm_mod.EngineArgs):
        def __post_init__(self):
            raise Stop(self.attention_config.indexer_kv_dtype)
    llm_mod.EngineArgs = Capture
    try:
        llm_mod.LLM(model="x", attention_config={"use_fp4_indexer_cache": True})
        out["llm"] = "no engine call"
    except Stop as e:
        out["llm"] = str(e)
    except Exception as e:
        out["llm"] = "error " + type(e).__name__ + ": " + str(e)[:300]
    print("RESULT " + json.dumps(out))
    parser.parse_args(["--attention-config",
                       '{"use_fp4_indexer_cache":true,"indexer_kv_dtype":"fp8"}'])
''')


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("flags")
    cfg = tmp / "serve.yaml"
    cfg.write_text('model: x\nattention-config: {"use_fp4_indexer_cache": true}\n')
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
               VLLM_DSV4_ATTN_IMPL="vllm")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(cfg)], capture_output=True,
                          text=True, timeout=240, env=env, cwd=Path(__file__).parent)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert lines, f"no result (rc {proc.returncode}):\n{tail}"
    return json.loads(lines[-1][len("RESULT "):]), proc


def test_vllm_033_alone_rejects_the_flag(result) -> None:
    out, _ = result
    assert "Unexpected keyword argument" in out["vllm_alone"]


def test_plugin_loaded_by_the_parser(result) -> None:
    assert result[0]["registered"] is True


@pytest.mark.parametrize("case,expected", [
    ("json_true", "mxfp4"), ("json_false", "fp8"), ("dotted", "mxfp4"), ("yaml", "mxfp4"),
    ("native", "mxfp4"), ("python", "mxfp4"),
])
def test_mapping(result, case: str, expected: str) -> None:
    assert result[0][case] == expected


def test_llm_api_mapping(result) -> None:
    assert result[0]["llm"] == "mxfp4"


def test_contradiction_is_a_clear_parser_error(result) -> None:
    _, proc = result
    assert proc.returncode == 2
    assert "Contradictory attention-config" in proc.stderr
