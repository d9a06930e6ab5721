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
    attn_cls_was_vllm = cpu_model.DeepseekV4CPUAttention is cpu_sparse.DeepseekV4CPUAttention

    # The hook point for the plugin's layer (module already imported: runs now).
    from vllm_dsv4_backend.vllm_compat import attention
    class ProbeAttention(cpu_sparse.DeepseekV4CPUAttention):
        pass
    applied = []
    attention.install_attention_layer(lambda: ProbeAttention, platform="cpu",
                                      on_applied=applied.append)
    installed = cpu_model.DeepseekV4CPUAttention is ProbeAttention
    try:
        attention.install_attention_layer(lambda: int, platform="cpu")
        bad_layer_error = None
    except hooks.PatchError as e:
        bad_layer_error = str(e)

    def unavailable():
        raise NotImplementedError("no layer for this platform")
    optional_notes = []
    attention.install_attention_layer(unavailable, platform="cpu", optional=True,
                                      on_applied=optional_notes.append)
    optional_kept = cpu_model.DeepseekV4CPUAttention is ProbeAttention
    try:
        attention.install_attention_layer(unavailable, platform="cpu")
        required_raised = False
    except hooks.PatchError as e:  # naming the entry, the provider's error chained
        required_raised = ("patch attention_layer" in str(e)
                           and isinstance(e.__cause__, NotImplementedError))
    print(json.dumps({
        "first": first, "second": second,
        "pending_after_first": pending_after_first,
        "pending_after_second": pending_after_second,
        "heavy_after_register": heavy,
        "ported": {k: hooks.is_port(v) for k, v in kinds.items()},
        "b1_keys": sorted(b1),
        "attn_cls_is_vllm": attn_cls_was_vllm,
        "probe_installed": installed,
        "probe_applied": applied,
        "bad_layer_error": bad_layer_error,
        "optional_kept": optional_kept,
        "optional_notes": optional_notes,
        "required_raised": required_raised,
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
    # The config hooks wait for vllm.engine.arg_utils, which only processes that
    # parse or build a config import, moe_expert_map for the CPU MoE experts module,
    # which only a worker building its MoE kernels imports, and pp_intermediate_buffer for
    # the model runner, which only a worker imports; every other model/kernel patch must
    # have applied.
    waiting_by_design = {"vllm.engine.arg_utils",
                         "vllm.model_executor.layers.fused_moe.experts.cpu_moe",
                         "vllm.v1.worker.gpu_model_runner"}
    assert not any(
        m.startswith("vllm.") and m not in waiting_by_design for m in r["pending_end"]
    ), r["pending_end"]


def test_attention_layer_hook_point(registered_process):
    r = registered_process
    assert r["probe_installed"], "install_attention_layer did not rebind DeepseekV4CPUAttention"
    assert r["probe_applied"] and "DeepseekV4CPUAttention=" in r["probe_applied"][0]
    err = r["bad_layer_error"]
    assert err is not None and "DeepseekV4Attention" in err and "0.32" in err
    # auto (optional): a provider without a layer for the platform keeps the
    # current layer, with a note; plugin (required): the error propagates.
    assert r["optional_kept"] and "plugin layer unavailable" in r["optional_notes"][0]
    assert r["required_raised"]


def test_version_gate():
    assert version.check_vllm_version("0.32.0") == (0, 32)
    assert version.check_vllm_version("0.32.0+cpu") == (0, 32)
    assert version.check_vllm_version("0.33.1") == (0, 33)
    assert version.check_vllm_version("0.34.0") == (0, 34)
    import vllm

    version.check_vllm_version(vllm.__version__)
    with pytest.raises(RuntimeError) as e:
        version.check_vllm_version("0.31.2")
    msg = str(e.value)
    assert "0.31.2" in msg and "0.32.x" in msg and "0.33.x" in msg and "0.34.x" in msg
    assert "VLLM_DSV4_SKIP_VERSION_CHECK=1" in msg
    # (version, platform) combinations the plugin has a layer for.
    assert version.support_problem("0.32.0+cpu", "cpu") is None
    assert version.support_problem("0.33.0", "cuda") is None
    assert version.support_problem("0.34.0", "cuda") is None
    assert "cpu platform" in version.support_problem("0.33.0", "cpu")
    assert "cpu platform" in version.support_problem("0.34.0", "cpu")
    assert "rocm platform" in version.support_problem("0.34.0", "rocm")
    assert "cuda platform" in version.support_problem("0.32.0", "cuda")
    assert "0.35.0" in version.support_problem("0.35.0", "cuda")


def test_version_gate_override(monkeypatch):
    monkeypatch.setenv("VLLM_DSV4_SKIP_VERSION_CHECK", "1")
    assert version.check_vllm_version("0.40.0") == (0, 40)
    assert version.support_problem("0.40.0", "cuda") is None
    # The override is about versions: a platform without a layer stays one.
    assert version.support_problem("0.40.0", "tpu") is not None


# What vLLM serves once the plugins are loaded through vLLM's own loader, as in
# every vLLM process: load_general_plugins() must return, the log must name
# the cause, and a DeepSeek-V4 model must get vLLM's own layer.
_STAND_ASIDE = """
import json, logging, sys
import vllm
{setup}
records = {{}}
class H(logging.Handler):
    def emit(self, r):  # a record seen by both loggers counts once
        records[(r.levelname, r.getMessage(), r.created)] = 1
for name in ("vllm", "vllm_dsv4_backend"):
    logging.getLogger(name).addHandler(H())
from vllm.plugins import load_general_plugins
out = {{}}
try:
    load_general_plugins()
    out["raised"] = None
except Exception as e:
    out["raised"] = type(e).__name__ + ": " + str(e)
import vllm_dsv4_backend.plugin as plugin
out["state"] = plugin.state()
if out["raised"] is None:
    # What vLLM does when it builds a DeepSeek-V4 model (the layer hook fires).
    import vllm.models.deepseek_v4.cpu.model as cpu_model
    from vllm.models.deepseek_v4.cpu import cpu_sparse
    out["layer_is_vllms"] = cpu_model.DeepseekV4CPUAttention is cpu_sparse.DeepseekV4CPUAttention
out["errors"] = [m for lvl, m, _ in records if lvl == "ERROR"]
print(json.dumps(out))
"""


@pytest.mark.parametrize("case,setup,cause", [
    ("unknown_version", 'vllm.__version__ = "0.35.0"', "does not support vLLM 0.35.0"),
    ("no_layer_for_platform", 'vllm.__version__ = "0.34.0"',
     "no DeepSeek-V4 layer for vLLM 0.34.0 on the cpu platform"),
    ("changed_body", ("from vllm_dsv4_backend.layer import cpu\n"
     "cpu.VLLM_DRIFT = {k: (r, {m: '0' * 16 for m in h}) for k, (r, h) in "
     "cpu.VLLM_DRIFT.items()}"),
     "source changed"),
])
def test_unsupported_combination_stands_aside(case, setup, cause):
    r = _run_python(_STAND_ASIDE.format(setup=setup), env={"VLLM_DSV4_ATTN_IMPL": "auto"})
    assert r["raised"] is None, r
    assert r["layer_is_vllms"], "a DeepSeek-V4 model must get vLLM's own layer"
    errors = [e for e in r["errors"] if cause in e]
    assert len(errors) == 1, r["errors"]
    if case != "changed_body":
        # One line: the installed vLLM, the supported versions, what it did.
        assert "0.32.x" in errors[0] and "0.33.x" in errors[0] and "0.34.x" in errors[0]
        assert "vLLM serves every model as if the plugin were absent" in errors[0]
        assert r["state"]["stood_aside"]
    else:
        assert "keeping vLLM's own DeepSeek-V4 attention layer" in errors[0]


@pytest.mark.parametrize("setup", ['vllm.__version__ = "0.35.0"', 'vllm.__version__ = "0.34.0"'])
def test_explicit_request_on_unsupported_combination_fails(setup):
    r = _run_python(_STAND_ASIDE.format(setup=setup), env={"VLLM_DSV4_ATTN_IMPL": "plugin"})
    assert r["raised"] is not None and r["raised"].startswith("RuntimeError")
    assert "0.32.x" in r["raised"] and "0.34.x" in r["raised"]
    assert "VLLM_DSV4_ATTN_IMPL=plugin" in r["raised"]


def test_skip_version_check_keeps_its_meaning():
    r = _run_python(_STAND_ASIDE.format(setup='vllm.__version__ = "0.32.9"'),
                    env={"VLLM_DSV4_SKIP_VERSION_CHECK": "1"})
    assert r["raised"] is None and "stood_aside" not in r["state"]
    r = _run_python(_STAND_ASIDE.format(setup='vllm.__version__ = "0.35.0"'),
                    env={"VLLM_DSV4_SKIP_VERSION_CHECK": "1", "VLLM_DSV4_ATTN_IMPL": "auto"})
    assert r["raised"] is None and "stood_aside" not in r["state"]


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


def test_cpu_layer_sparse_mla_setting(monkeypatch):
    """VLLM_DSV4_KERNEL picks the CPU layer's sparse MLA: ``torch`` the plugin's, ``auto``
    the op vLLM's layer calls; ``vllm_cpu`` refuses the plugin's registered fallback (it is
    not vLLM's kernel), a bad value fails with envs' error."""
    from vllm_dsv4_backend.layer import cpu as cpu_layer
    from vllm_dsv4_backend.vllm_compat import cpu_ops

    assert cpu_layer._sparse_mla_path("torch") == "torch"
    assert cpu_layer._sparse_mla_path("auto") == "vllm_cpu"
    monkeypatch.setattr(cpu_ops, "is_fallback", lambda name: True)
    assert cpu_layer._sparse_mla_path("auto") == "vllm_cpu"
    with pytest.raises(RuntimeError, match="VLLM_DSV4_KERNEL=vllm_cpu, but vLLM's C"):
        cpu_layer._sparse_mla_path("vllm_cpu")
    monkeypatch.setenv("VLLM_DSV4_KERNEL", "flashmla")
    with pytest.raises(ValueError, match="VLLM_DSV4_KERNEL: expected one of"):
        _ = envs.VLLM_DSV4_KERNEL


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
    r = tiny_server.complete("The quick brown fox", 4, logprobs=5)
    with open(os.path.join(ROOT, "configs/tiny-dsv4/config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    uniform = -math.log(vocab)
    for top in r["choices"][0]["logprobs"]["top_logprobs"]:
        vals = sorted(top.values(), reverse=True)
        assert len(vals) >= 2
        # vLLM's default dummy weights give every token logprob -ln(vocab).
        assert vals[0] - vals[-1] > 0.05, f"near-uniform top logprobs {vals}"
        assert abs(vals[0] - uniform) > 0.05, f"top logprob {vals[0]} ~ uniform {uniform}"


# ----------------------------------------------------------------------------
# torch fallbacks for the C++ ops (called directly: nothing is registered into
# torch.ops._C of this process, so other tests still see the real library)
# ----------------------------------------------------------------------------
def _softplus_sqrt64(x):
    import torch

    x = x.double()
    return torch.sqrt(torch.where(x > 20.0, x, torch.log1p(torch.exp(x))))


def test_fallback_biased_topk_matches_float64_loop_with_ties():
    import torch

    from vllm_dsv4_backend.vllm_compat import cpu_ops

    g = torch.Generator().manual_seed(0)
    t, e, k, rsf = 7, 64, 6, 1.5
    logits = torch.randn(t, e, generator=g)
    logits[0, :] = 0.25  # every key ties in row 0 (with a zero bias): lowest ids win
    logits[1, 10] = logits[1, 3] = 30.0  # a tie above the softplus threshold
    for bias in (torch.zeros(e), torch.randn(e, generator=g) * 0.05):
        w, ids = cpu_ops.biased_topk_cpu(
            logits, logits, bias, k, True, "sqrtsoftplus", 0, rsf, True
        )
        assert w.dtype == torch.float32 and ids.dtype == torch.int32
        sp = _softplus_sqrt64(logits)
        key = sp + bias.double()
        for r in range(t):
            order = sorted(range(e), key=lambda j, r=r: (-float(key[r, j]), j))[:k]
            assert ids[r].tolist() == order
            ref = sp[r, order] / sp[r, order].sum() * rsf
            torch.testing.assert_close(w[r].double(), ref, rtol=1e-5, atol=1e-6)
    w, ids = cpu_ops.biased_topk_cpu(
        logits, logits, torch.zeros(e), k, True, "sqrtsoftplus", 0, rsf, True
    )
    assert ids[0].tolist() == list(range(k))
    assert ids[1].tolist()[:2] == [3, 10]


def test_fallback_hash_topk_matches_float64():
    import torch

    from vllm_dsv4_backend.vllm_compat import cpu_ops

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 64, generator=g) * 4
    tid = torch.randint(0, 64, (5, 6), generator=g, dtype=torch.int32)
    w, ids = cpu_ops.hash_topk_cpu(logits, tid, 6, "sqrtsoftplus", 0, 64, 1.5)
    assert torch.equal(ids, tid)
    sp = _softplus_sqrt64(logits).gather(1, tid.long())
    torch.testing.assert_close(w.double(), sp / sp.sum(-1, keepdim=True) * 1.5, rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(ValueError, match="tid2eid"):
        cpu_ops.hash_topk_cpu(logits, tid + 64, 6, "sqrtsoftplus", 0, 64, 1.5)


def test_fallback_bmm_and_packing():
    import torch

    from vllm_dsv4_backend.vllm_compat import cpu_ops

    g = torch.Generator().manual_seed(2)
    w = torch.randn(2, 48, 96, generator=g).to(torch.bfloat16)
    a = torch.randn(2, 5, 96, generator=g).to(torch.bfloat16)
    out = torch.full((2, 5, 48), float("nan"), dtype=torch.bfloat16)
    cpu_ops.bmm_cpu(out, a, cpu_ops.convert_weight_packed(w), True, None)
    ref = torch.einsum("gmk,gnk->gmn", a.double(), w.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    with pytest.raises(NotImplementedError):
        cpu_ops.bmm_cpu(out, a, w, True, torch.ones(1))


def test_fallback_mhc_ops_match_float64():
    import torch

    from vllm_dsv4_backend.vllm_compat import cpu_ops

    g = torch.Generator().manual_seed(3)
    t, hc, d, iters, eps, rms_eps = 4, 4, 64, 20, 1e-6, 1e-6
    x = torch.randn(t, hc, d, generator=g).to(torch.bfloat16)
    fn = torch.randn((2 + hc) * hc, hc * d, generator=g) / (hc * d) ** 0.5
    scale = torch.tensor([0.9, 1.1, 1.2])
    base = torch.randn((2 + hc) * hc, generator=g) * 0.1
    li, post, comb = cpu_ops.hc_pre_fused_cpu(x, fn, scale, base, hc, iters, rms_eps, eps)

    xf = x.double().reshape(t, hc * d)
    mixes = (xf @ fn.double().t()) / torch.sqrt(xf.square().mean(-1, keepdim=True) + rms_eps)
    s, b = scale.double(), base.double()
    pre = torch.sigmoid(mixes[:, :hc] * s[0] + b[:hc]) + eps
    post_ref = torch.sigmoid(mixes[:, hc:2 * hc] * s[1] + b[hc:2 * hc]) * 2.0
    c = torch.softmax(mixes[:, 2 * hc:].reshape(t, hc, hc) * s[2] + b[2 * hc:].reshape(hc, hc),
                      dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    li_ref = (pre.unsqueeze(-1) * x.double()).sum(1)
    torch.testing.assert_close(post.double(), post_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(comb.double(), c, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(li.double(), li_ref, rtol=2e-2, atol=2e-2)

    y = torch.randn(t, d, generator=g).to(torch.bfloat16)
    out = cpu_ops.hc_post_fused_cpu(y, x, post, comb)
    ref = torch.einsum("tij,tid->tjd", comb.double(), x.double()) + post.double().unsqueeze(
        -1) * y.double().unsqueeze(1)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)

    hfn = torch.randn(hc, hc * d, generator=g) / (hc * d) ** 0.5
    hs, hb = torch.tensor([1.3]), torch.randn(hc, generator=g) * 0.1
    head = cpu_ops.hc_head_fused_cpu(x, hfn, hs, hb, eps, rms_eps)
    xn = xf / torch.sqrt(xf.square().mean(-1, keepdim=True) + rms_eps)
    gate = torch.sigmoid((xn @ hfn.double().t()) * 1.3 + hb.double()) + eps
    torch.testing.assert_close(head.double(), (gate.unsqueeze(-1) * x.double()).sum(1),
                               rtol=2e-2, atol=2e-2)


def test_fallback_flash_mla_matches_float64_attention():
    """The wrapper maps vLLM's 2-D cache views, int64 slot tables, -1 and
    out-of-range slots (skipped) and the sink onto a float64 softmax."""
    import torch

    from vllm_dsv4_backend.formats import fp8_ds_mla
    from vllm_dsv4_backend.vllm_compat import cpu_ops

    g = torch.Generator().manual_seed(4)
    t, h, wb, cb, nb = 3, 8, 64, 2, 6
    win = fp8_ds_mla.allocate_cache(nb, wb, padded=True)
    comp = fp8_ds_mla.allocate_cache(nb, cb, padded=True)
    win_rows = (torch.randn(nb * wb, 512, generator=g) * 0.5).to(torch.bfloat16)
    comp_rows = (torch.randn(nb * cb, 512, generator=g) * 0.5).to(torch.bfloat16)
    fp8_ds_mla.quantize_and_insert(win_rows, win, torch.arange(nb * wb))
    fp8_ds_mla.quantize_and_insert(comp_rows, comp, torch.arange(nb * cb))
    win_2d = win.as_strided((nb, win.stride(0)), (win.stride(0), 1))
    comp_2d = comp.as_strided((nb, comp.stride(0)), (comp.stride(0), 1))
    win_slots = torch.randint(0, nb * wb, (t, 10), generator=g)
    win_slots[:, 7:] = -1
    win_slots[0, 6] = nb * wb + 5  # past the cache: skipped like the C++ kernel
    comp_slots = torch.randint(0, nb * cb, (t, 4), generator=g)
    comp_slots[2, :] = -1
    q = (torch.randn(t, h, 512, generator=g) * 0.3).to(torch.bfloat16)
    sink = torch.randn(h, generator=g)
    scale = 512**-0.5
    out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16)
    cpu_ops.flash_mla_with_kvcache_cpu(out, q, win_2d, win_slots, wb, comp_2d, comp_slots, cb,
                                       sink, scale)

    kw = fp8_ds_mla.dequantize_and_gather(win, torch.arange(nb * wb)).double()
    kc = fp8_ds_mla.dequantize_and_gather(comp, torch.arange(nb * cb)).double()
    for i in range(t):
        ks = [kw[s] for s in win_slots[i].tolist() if 0 <= s < nb * wb]
        ks += [kc[s] for s in comp_slots[i].tolist() if 0 <= s < nb * cb]
        k = torch.stack(ks)
        sc = q[i].double() @ k.t() * scale  # [h, n]
        m = torch.maximum(sc.max(-1).values, sink.double())
        p = torch.exp(sc - m[:, None])
        den = p.sum(-1) + torch.exp(sink.double() - m)
        ref = (p @ k) / den[:, None]
        torch.testing.assert_close(out[i].double(), ref, rtol=2e-2, atol=1e-2)


def test_dummy_init_rules_and_determinism():
    import torch

    from vllm_dsv4_backend.vllm_compat import dummy_init

    assert dummy_init.spec_from_config({"x": 1}) is None
    marker = {dummy_init.MARKER_KEY: {"kind": "fan_in_normal", "seed": 3}}
    spec = dummy_init.spec_from_config(marker)
    assert spec.seed == 3
    with pytest.raises(ValueError, match="vllm_dsv4_dummy_init.kind"):
        dummy_init.spec_from_config({dummy_init.MARKER_KEY: {"kind": "uniform"}})
    with pytest.raises(ValueError, match="vllm_dsv4_dummy_init.seed"):
        dummy_init.spec_from_config({dummy_init.MARKER_KEY: {"seed": -1}})

    def make():
        return {
            "a.weight": torch.empty(512, 1024, dtype=torch.bfloat16),
            "experts.w13": torch.empty(4, 64, 256, dtype=torch.float32),
            "norm.weight": torch.empty(4096, dtype=torch.bfloat16),
            "attn.attn_sink": torch.full((8,), float("-inf")),
            "scalar": torch.empty((), dtype=torch.float32),
            "q.weight_fp8": torch.empty(64, 128, dtype=torch.float8_e4m3fn),
            "x.weight_scale": torch.zeros(4, 4, dtype=torch.uint8),
            "e8.weight_scale_inv": torch.zeros(3, dtype=torch.float8_e8m0fnu),
            "gate.tid2eid": torch.full((5, 6), 7, dtype=torch.int32),
        }

    a, b = make(), make()
    stats = dummy_init.init_fan_in_normal_(list(a.items()), seed=0)
    dummy_init.init_fan_in_normal_(list(reversed(list(b.items()))), seed=0)  # order-free
    assert stats == {"initialised": 8, "untouched": 1}
    for k in a:
        bytes_a = a[k].reshape(-1).view(torch.uint8)
        assert torch.equal(bytes_a, b[k].reshape(-1).view(torch.uint8)), k
    std = a["a.weight"].float().std().item()
    assert abs(std - 1024**-0.5) < 0.05 * 1024**-0.5
    assert abs(a["experts.w13"].std().item() - 256**-0.5) < 0.05 * 256**-0.5
    for k in ("norm.weight", "attn.attn_sink"):
        v = a[k].float()
        # U(0.9, 1.1), rounded to the tensor dtype (bf16: 0.8984 is allowed)
        assert torch.isfinite(v).all() and v.min() >= 0.89 and v.max() <= 1.11, k
    assert a["scalar"].item() == 1.0
    assert a["q.weight_fp8"].float().abs().max() > 0
    assert (a["x.weight_scale"] == 127).all()
    assert (a["e8.weight_scale_inv"].float() == 1.0).all()
    assert (a["gate.tid2eid"] == 7).all()
    c = make()
    dummy_init.init_fan_in_normal_(list(c.items()), seed=1)
    assert not torch.equal(a["a.weight"], c["a.weight"])
