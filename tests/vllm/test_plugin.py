# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plugin entry point against a real vLLM (CPU build): registration, version
gate, env vars, patch hook points, and proof from inside the engine-core and
worker processes of a running server that the plugin ran there."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import types

import pytest

pytest.importorskip("vllm")

from vllm_dsv4_backend import envs  # noqa: E402
from vllm_dsv4_backend.vllm_compat import hooks, version  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_python(code: str, env: dict | None = None, timeout: float = 600) -> dict:
    """Run ``code`` in a fresh interpreter (patches must not leak into pytest's
    process); it prints one JSON object as its last stdout line."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full_env,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------
# in a fresh process, no engine
# ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def registered_process(tmp_path_factory) -> dict:
    """register() twice, then import vLLM's DeepSeek-V4 CPU model, in one subprocess."""
    marker_dir = tmp_path_factory.mktemp("markers")
    code = """
    import json, os, sys
    from vllm_dsv4_backend import plugin
    from vllm_dsv4_backend.vllm_compat import hooks
    plugin.register()
    first = plugin.state()
    pending_after_first = hooks.pending()
    heavy = sorted(m for m in sys.modules if m.startswith("vllm.models.deepseek_v4"))
    plugin.register()
    second = plugin.state()
    pending_after_second = hooks.pending()

    # vLLM imports the model module when it builds the model: patches apply now.
    import vllm.models.deepseek_v4.cpu.model as cpu_model
    from vllm.models.deepseek_v4.cpu import cpu_mla, cpu_sparse
    from vllm.v1.attention.backends.mla import compressor_utils, indexer, sparse_swa
    from vllm.v1.attention.ops import metadata as vmeta
    from vllm.models.deepseek_v4 import sparse_mla
    from vllm_dsv4_backend.vllm_compat import cpu_ops

    kinds = {
        "T1": vmeta.compute_token_to_req_indices,
        "T1b": sparse_swa.compute_token_to_req_indices,
        "T2": compressor_utils._COMPRESSED_SLOT_MAPPING_KERNEL,
        "T3": indexer._BUILD_PREFILL_CHUNK_METADATA_KERNEL,
        "T4": sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL,
        "T5": sparse_swa._COMPUTE_PREFILL_METADATA_KERNEL,
        "T6": sparse_swa._COMPUTE_DSPARK_NONCAUSAL_SWA_INDICES_KERNEL,
        "T7": indexer._PREPARE_UNIFORM_DECODE_KERNEL,
        "T8": sparse_mla._BUILD_C128A_TOPK_METADATA_KERNEL,
    }
    b1 = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler(None, 0)
    print(json.dumps({
        "first": first, "second": second,
        "pending_after_first": pending_after_first,
        "pending_after_second": pending_after_second,
        "heavy_after_register": heavy,
        "ported": {k: hooks.is_port(v) for k, v in kinds.items()},
        "b1_keys": sorted(b1),
        "attn_cls_is_vllm": cpu_model.DeepseekV4CPUAttention is cpu_sparse.DeepseekV4CPUAttention,
        "fallbacks": cpu_ops.registered(),
        "missing_after": cpu_ops.missing_ops(),
        "pending_end": hooks.pending(),
        "markers": os.listdir(os.environ["VLLM_DSV4_MARKER_DIR"]),
    }))
    """
    return _run_python(
        code, env={"VLLM_DSV4_MARKER_DIR": str(marker_dir), "VLLM_DSV4_ATTN_IMPL": "vllm"}
    )


def test_register_is_idempotent_and_lazy(registered_process):
    r = registered_process
    assert r["first"] == r["second"], "a second register() changed the plugin state"
    assert r["pending_after_first"] == r["pending_after_second"], "second call re-armed hooks"
    # Cheap: register() itself imports none of the DeepSeek-V4 modules it patches.
    assert r["heavy_after_register"] == []
    assert r["first"]["armed"][:9] == ["T1", "T2", "T3", "T4", "T5", "T6", "T7", "T8", "B1"]
    assert r["first"]["role"] == "frontend" and r["first"]["platform"] == "cpu"
    assert len(r["markers"]) == 1


def test_patches_apply_when_vllm_imports_the_model(registered_process):
    r = registered_process
    assert r["ported"] == {k: True for k in r["ported"]}
    # B1: the shared SWA builder reads c1a/c2a as well.
    assert {"swaonly", "c4a", "c128a", "c1a", "c2a"} <= set(r["b1_keys"])
    assert r["attn_cls_is_vllm"], "VLLM_DSV4_ATTN_IMPL=vllm must keep vLLM's layer"
    assert r["missing_after"] == [], "DeepSeek-V4 CPU ops still missing after the fallbacks"
    assert not any(m.startswith("vllm.") for m in r["pending_end"])


def test_version_gate():
    assert version.check_vllm_version("0.32.0") == (0, 32)
    assert version.check_vllm_version("0.32.0+cpu") == (0, 32)
    assert version.check_vllm_version("0.33.1") == (0, 33)
    import vllm

    version.check_vllm_version(vllm.__version__)
    with pytest.raises(RuntimeError) as e:
        version.check_vllm_version("0.31.2")
    msg = str(e.value)
    assert "0.31.2" in msg and "0.32.x" in msg and "0.33.x" in msg
    assert "VLLM_DSV4_SKIP_VERSION_CHECK=1" in msg


def test_version_gate_override(monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_SKIP_VERSION_CHECK", "1")
    assert version.check_vllm_version("0.40.0") == (0, 40)


def test_register_refuses_unsupported_vllm_in_fresh_process():
    code = """
    import json, vllm
    vllm.__version__ = "0.29.1"
    from vllm_dsv4_backend import plugin
    try:
        plugin.register()
        print(json.dumps({"raised": None}))
    except RuntimeError as e:
        print(json.dumps({"raised": str(e)}))
    """
    r = _run_python(code)
    assert r["raised"] is not None and "0.29.1" in r["raised"] and "0.32.x" in r["raised"]


def test_env_vars_lazy_validated_and_known_to_vllm(monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_WORKSPACE", "private")
    assert envs.VLLM_DSV4_WORKSPACE == "private"
    monkeypatch.setenv("VLLM_DSV4_WORKSPACE", "bogus")
    with pytest.raises(ValueError, match="VLLM_DSV4_WORKSPACE"):
        _ = envs.VLLM_DSV4_WORKSPACE
    monkeypatch.setenv("VLLM_DSV4_KERNEL", "torch")
    assert envs.VLLM_DSV4_KERNEL == "torch"
    monkeypatch.delenv("VLLM_DSV4_ATTN_IMPL", raising=False)
    assert envs.VLLM_DSV4_ATTN_IMPL == "auto"
    import vllm.envs as vllm_envs

    assert envs.register_with_vllm()
    for name in ("VLLM_DSV4_WORKSPACE", "VLLM_DSV4_WORKSPACE_DEBUG", "VLLM_DSV4_KERNEL",
                 "VLLM_DSV4_ATTN_IMPL", "VLLM_DSV4_SKIP_VERSION_CHECK"):
        assert name in vllm_envs.environment_variables
    assert vllm_envs.VLLM_DSV4_KERNEL == "torch"


def test_missing_hook_point_is_loud():
    fake = types.ModuleType("vllm.fake_module")
    with pytest.raises(hooks.PatchError) as e:
        hooks.replace_attr(fake, "_SOME_KERNEL", lambda: None)
    import vllm

    assert vllm.__version__ in str(e.value) and "vllm.fake_module._SOME_KERNEL" in str(e.value)

    def kernel(a, b):
        return a

    fake._SOME_KERNEL = kernel
    with pytest.raises(hooks.PatchError, match=r"signature is \(a, b\), expected \(a, c\)"):
        hooks.replace_attr(fake, "_SOME_KERNEL", lambda a, c: a, expected_params=("a", "c"))
    assert hooks.replace_attr(fake, "_SOME_KERNEL", lambda a, b: b, expected_params=("a", "b"))
    assert not hooks.replace_attr(fake, "_SOME_KERNEL", lambda a, b: b)  # already ours


# ----------------------------------------------------------------------------
# inside a running server
# ----------------------------------------------------------------------------
def test_plugin_ran_in_engine_core_and_worker(tiny_server):
    markers = {m["role"]: m for m in tiny_server.markers()}
    assert {"frontend", "engine_core", "worker"} <= set(markers), sorted(markers)
    front, core, worker = markers["frontend"], markers["engine_core"], markers["worker"]
    # Three distinct processes in vLLM's tree: API server -> engine core -> worker.
    assert len({front["pid"], core["pid"], worker["pid"]}) == 3
    assert worker["ppid"] == core["pid"]
    assert core["process_name"].startswith("EngineCore")
    assert worker["process_name"].startswith("VllmWorker")
    # The worker built the model: every metadata patch, B1 and the dummy-init
    # hook were applied inside it.
    applied = " ".join(worker["applied"])
    for key in ("T1:", "T2:", "T3:", "T4:", "T5:", "T6:", "T7:", "T8:", "B1:", "dummy_init:"):
        assert key in applied, f"{key} not applied in the worker: {worker['applied']}"
    log = tiny_server.log_text()
    line = "vllm_dsv4_backend 0.1.0: registered FLASHMLA_SPARSE_DSV4"
    # Printed through vLLM's handlers, so with vLLM's process prefixes.
    assert any(line in ln and "EngineCore" in ln for ln in log.splitlines())
    assert any(line in ln and "Worker" in ln for ln in log.splitlines())


def test_dummy_init_marker_gives_informative_logprobs(tiny_server):
    r = tiny_server.post("/v1/completions", {
        "model": tiny_server.model, "prompt": "The quick brown fox", "max_tokens": 4,
        "temperature": 0.0, "logprobs": 5, "ignore_eos": True,
    })  # fmt: skip
    with open(os.path.join(ROOT, "configs/tiny-dsv4/config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    uniform = -math.log(vocab)
    for top in r["choices"][0]["logprobs"]["top_logprobs"]:
        vals = sorted(top.values(), reverse=True)
        assert len(vals) >= 2
        # vLLM's default dummy weights give every token logprob -ln(vocab).
        assert vals[0] - vals[-1] > 0.05, f"near-uniform top logprobs {vals}"
        assert abs(vals[0] - uniform) > 0.05, f"top logprob {vals[0]} ~ uniform {uniform}"
