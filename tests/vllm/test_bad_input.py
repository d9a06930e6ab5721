# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bad input at the server: clear errors, and the server keeps serving.

Requests (against the session's tiny-model server, ``tiny_server`` in
``tests/vllm/conftest.py``; no extra server): a prompt longer than
``max-model-len`` (as token ids and as text), a prompt that leaves no room for
one new token, empty prompts, ``max_tokens`` 0 or negative (also in a chat request).
Each must get an HTTP 4xx whose message names the problem, and the next valid
request must still succeed on the same, still-running server.

Startup (no engine is built, so these are cheap): malformed
``--attention-config`` JSON and an unknown indexer dtype
(``{"indexer_kv_dtype":"int3"}``) must make ``vllm serve`` exit non-zero with
a message that names the flag and the bad value.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.support.vllm_helpers import healthy, local_serve_config  # noqa: E402
from vllm_dsv4_backend import run as R  # noqa: E402

pytestmark = [pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
SERVE_CONFIG = Path(
    os.environ.get("DSV4_TEST_SERVE_CONFIG", ROOT / "configs/serve/tiny-dsv4-cpu.yaml")
)
SCRATCH = Path(os.environ.get("DSV4_SCRATCH", ROOT / ".scratch"))
STARTUP_ERROR_TIMEOUT_S = 300  # a bound for a hung process, not a speed assertion


def _post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


# ---------------------------------------------------------------- startup errors


def _serve_with(*flags: str) -> subprocess.CompletedProcess[str]:
    serve = R.load_serve_config(SERVE_CONFIG)
    cmd = R.build_serve_command(serve, host="127.0.0.1", port=R.find_free_port(),
                                extra_args=list(flags))  # fmt: skip
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=STARTUP_ERROR_TIMEOUT_S,
        env=R.cpu_env(SCRATCH), stdin=subprocess.DEVNULL,
    )  # fmt: skip


STARTUP_CASES = {
    "malformed-json": (
        '{"indexer_kv_dtype": "fp8",',
        ["--attention-config", "json_invalid"],
    ),
    "unknown-indexer-dtype": (
        '{"indexer_kv_dtype":"int3"}',
        ["--attention-config", "indexer_kv_dtype", "int3", "mxfp4"],
    ),
}


@pytest.fixture(scope="module")
def startup_runs() -> dict[str, subprocess.CompletedProcess[str]]:
    """All bad-startup commands at once (each is an interpreter start + vLLM import)."""
    local_serve_config(SERVE_CONFIG)
    with ThreadPoolExecutor(len(STARTUP_CASES)) as pool:
        futs = {k: pool.submit(_serve_with, "--attention-config", v[0])
                for k, v in STARTUP_CASES.items()}  # fmt: skip
        return {k: f.result() for k, f in futs.items()}


@pytest.mark.parametrize("case", list(STARTUP_CASES))
def test_bad_attention_config_fails_at_startup(startup_runs, case: str) -> None:
    out = startup_runs[case]
    text = out.stdout + out.stderr
    assert out.returncode != 0, f"{case}: vllm serve accepted it:\n{text[-2000:]}"
    assert out.returncode == 2, f"{case}: expected argparse's exit code 2, got {out.returncode}"
    for w in STARTUP_CASES[case][1]:
        assert w in text, f"{case}: startup error should mention {w!r}:\n{text[-2000:]}"
    # it failed while parsing arguments: no engine was started
    assert "Starting vLLM" not in text and "EngineCore" not in text


def test_attention_config_parsing_in_process(capsys) -> None:
    """The same parser in-process: valid values pass (the control for the cases
    above), and more bad spellings fail with argparse's exit code 2 and a message."""
    import vllm.entrypoints.cli.serve as serve_mod
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    sub = parser.add_subparsers(dest="subparser")
    for cmd in serve_mod.cmd_init():
        cmd.subparser_init(sub)

    def parse(value: str):
        return parser.parse_args(
            ["serve", "--config", str(SERVE_CONFIG), "--attention-config", value]
        )

    for dtype in ("fp8", "mxfp4", "auto"):
        assert (
            parse(json.dumps({"indexer_kv_dtype": dtype})).attention_config.indexer_kv_dtype
            == dtype
        )
    bad = {
        '{"indexer_kv_dtype":"int3"}': "int3",
        '{"indexer_kv_dtype":"fp4"}': "fp4",
        '{"indexer_kv_dtyp":"fp8"}': "indexer_kv_dtyp",
        '{"indexer_kv_dtype": fp8}': "json_invalid",
        "indexer_kv_dtype=fp8": "json_invalid",
    }
    for value, word in bad.items():
        with pytest.raises(SystemExit) as e:
            parse(value)
        err = capsys.readouterr().err
        assert e.value.code == 2, value
        assert "--attention-config" in err and word in err, (value, err[-1000:])


# ---------------------------------------------------------------- requests


@dataclass(frozen=True)
class Target:
    """The server under test: the session's tiny-model server (tests/vllm/conftest.py)."""

    base_url: str
    model: str
    max_model_len: int

    def healthy(self) -> bool:
        return healthy(self.base_url)


@pytest.fixture(scope="module")
def server(tiny_server) -> Target:
    """Reuses the session server (any attention impl): bad input is a front-end matter."""
    with urllib.request.urlopen(tiny_server.base_url + "/v1/models", timeout=30) as r:
        card = json.loads(r.read())["data"][0]
    assert card["id"] == tiny_server.model
    return Target(tiny_server.base_url, tiny_server.model, int(card["max_model_len"]))


def _ok_completion(srv: Target) -> None:
    """The server still answers a normal request (and /health) after the bad one."""
    code, body = _post(
        f"{srv.base_url}/v1/completions",
        {"model": srv.model, "prompt": "Question: 1 + 1\nAnswer:", "max_tokens": 4,
         "temperature": 0.0, "ignore_eos": True},
    )  # fmt: skip
    assert code == 200, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4
    assert srv.healthy()


def _bad_requests(max_len: int) -> list[tuple[str, str, dict, list[str]]]:
    """(id, endpoint, body, words the error message must contain)."""
    comp, chat = "/v1/completions", "/v1/chat/completions"
    return [
        ("ids-longer-than-max-model-len", comp,
         {"prompt": [5] * (max_len + 10), "max_tokens": 4}, ["maximum context length"]),
        ("text-longer-than-max-model-len", comp,
         {"prompt": "hello " * (max_len * 8), "max_tokens": 4}, ["maximum context length"]),
        ("prompt-fills-context", comp,
         {"prompt": [5] * max_len, "max_tokens": 1}, ["max_tokens"]),
        ("empty-text-prompt", comp, {"prompt": "", "max_tokens": 4}, ["prompt"]),
        ("empty-prompt-list", comp, {"prompt": [], "max_tokens": 4}, ["prompt"]),
        ("max-tokens-0", comp, {"prompt": "hello", "max_tokens": 0}, ["max_tokens", "0"]),
        ("max-tokens-negative", comp, {"prompt": "hello", "max_tokens": -3}, ["max_tokens"]),
        ("chat-max-tokens-0", chat,
         {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, ["max_tokens"]),
    ]  # fmt: skip


CASE_IDS = [c[0] for c in _bad_requests(16)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASE_IDS)
def test_bad_request_gets_4xx_and_server_keeps_serving(server: Target, case: str) -> None:
    srv = server
    _, endpoint, body, words = next(c for c in _bad_requests(srv.max_model_len) if c[0] == case)
    code, resp = _post(srv.base_url + endpoint, {"model": srv.model, **body})
    assert 400 <= code < 500, f"{case}: expected a 4xx, got {code}: {resp}"
    msg = json.dumps(resp.get("error", resp))
    for w in words:
        assert w in msg, f"{case}: error should mention {w!r}: {msg}"
    _ok_completion(srv)


@pytest.mark.slow
def test_burst_of_bad_requests_then_good(server: Target) -> None:
    """Many invalid requests at once do not wedge the engine."""
    srv = server
    url = f"{srv.base_url}/v1/completions"
    bodies = [c[2] for c in _bad_requests(srv.max_model_len)] * 3
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda b: _post(url, {"model": srv.model, **b})[0],
                              [b for b in bodies if "messages" not in b]))  # fmt: skip
    assert all(400 <= c < 500 for c in codes), codes
    _ok_completion(srv)
