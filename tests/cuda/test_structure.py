# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The facts the plugin's CUDA layer relies on, against vLLM 0.33's and 0.34's
real classes (imported on CPU, one environment each), and its installation by
``register()`` on a simulated CUDA platform."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import types

import pytest

from tests.support.cuda_guard import require_vllm_cuda, vllm_minor

require_vllm_cuda()
MINOR = vllm_minor()

import vllm.models.deepseek_v4.nvidia.model as nvm  # noqa: E402
from vllm.models.deepseek_v4.attention import DeepseekV4Attention  # noqa: E402
from vllm.models.deepseek_v4.nvidia import dspark, mtp  # noqa: E402
from vllm.models.deepseek_v4.nvidia.flashmla import (  # noqa: E402
    DeepseekSparseSWAFlashMLABackend,
    DeepseekV4FlashMLAAttention,
)
from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLABackend  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from vllm_dsv4_backend import plugin  # noqa: E402
from vllm_dsv4_backend.layer import cuda, get_attention_layer_cls  # noqa: E402
from vllm_dsv4_backend.vllm_compat import (  # noqa: E402
    attention,
    attention_config,
    fingerprints,
    hooks,
)

PLUGIN = cuda.DSV4FlashMLAAttention
# The CUDA layer's drift table, per role, for this vLLM.
DECORATED = tuple(s.rsplit(".", 1)[-1]
                  for s in fingerprints.symbols(cuda.VLLM_DRIFT, MINOR, fingerprints.DECORATED))
# Every method the plugin overrides on the layer, and the vLLM class it overrides.
LAYER_OVERRIDES = ("__init__", "forward", "_alloc_attn_out", "_sparse_indexer_and_attn",
                   "_forward_decode", "_get_indexer_cls")


def _params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_get_attention_layer_cls_cuda_is_the_plugin_subclass() -> None:
    cls = get_attention_layer_cls("cuda")
    assert cls is PLUGIN
    assert issubclass(cls, DeepseekV4FlashMLAAttention)
    assert cls.__mro__[:3] == (PLUGIN, DeepseekV4FlashMLAAttention, DeepseekV4Attention)


def test_backend_is_vllms_flashmla_sparse_dsv4() -> None:
    assert PLUGIN.backend_cls is DeepseekV4FlashMLABackend
    assert PLUGIN.swa_backend_cls is DeepseekSparseSWAFlashMLABackend
    assert PLUGIN.backend_cls.get_name() == "FLASHMLA_SPARSE_DSV4"
    assert AttentionBackendEnum.FLASHMLA_SPARSE_DSV4.get_class() is DeepseekV4FlashMLABackend


def test_abstract_seams() -> None:
    assert DeepseekV4Attention.__abstractmethods__ == frozenset(
        {"_o_proj", "forward_mqa", "get_padded_num_q_heads"})
    assert PLUGIN.__abstractmethods__ == frozenset()
    # The plugin keeps vLLM's implementations of the seams.
    for name in ("_o_proj", "forward_mqa", "get_padded_num_q_heads"):
        assert name not in PLUGIN.__dict__


@pytest.mark.parametrize("name", LAYER_OVERRIDES)
def test_override_signatures_match_vllm(name: str) -> None:
    ours = PLUGIN.__dict__[name]
    theirs = getattr(DeepseekV4FlashMLAAttention, name)
    if name == "__init__":
        # vLLM's FlashMLA __init__ is (*args, **kwargs) forwarding to the base.
        theirs = DeepseekV4Attention.__init__
    assert _params(ours) == _params(theirs)


@pytest.mark.parametrize("owner,base,name", [
    (cuda.DSV4CudaIndexer, cuda.DeepseekV4Indexer, "_q_rope_quant"),
    (cuda.DSV4CudaCompressor, cuda.DeepseekCompressor, "_compress_norm_rope_store"),
])
def test_submodule_override_signatures(owner: type, base: type, name: str) -> None:
    assert _params(owner.__dict__[name]) == _params(getattr(base, name))


def test_decorators_kept() -> None:
    # vLLM decorates these with eager_break_during_capture (0.34 removed MRV1's
    # _prepare_and_attn_eager)...
    assert set(DECORATED) == {
        n for n in dir(DeepseekV4Attention)
        if hasattr(getattr(DeepseekV4Attention, n), "__wrapped__")
        and n.startswith("_") and not n.startswith("__")
    }
    for name in DECORATED:
        assert hasattr(getattr(DeepseekV4Attention, name), "__wrapped__"), name
    assert hasattr(DeepseekV4Attention, "_prepare_and_attn_eager") == (MINOR == "0.33")
    # ...and every override of a decorated method carries it again.
    for name, fn in PLUGIN.__dict__.items():
        base = getattr(DeepseekV4FlashMLAAttention, name, None)
        if callable(fn) and hasattr(base, "__wrapped__"):
            assert hasattr(fn, "__wrapped__"), f"{name} lost eager_break_during_capture"
    assert hasattr(PLUGIN._sparse_indexer_and_attn, "__wrapped__")


def test_patch_point_reaches_every_decoder_layer() -> None:
    assert nvm.DeepseekV4FlashMLAAttention.__name__ == "DeepseekV4FlashMLAAttention"
    assert "_select_dsv4_attn_cls" in nvm.DeepseekV4DecoderLayer.__init__.__code__.co_names
    assert "DeepseekV4FlashMLAAttention" in nvm._select_dsv4_attn_cls.__code__.co_names
    # MTP and DSpark build their layers through the same DecoderLayer class.
    assert mtp.DeepseekV4DecoderLayer is nvm.DeepseekV4DecoderLayer
    assert dspark.DeepseekV4DecoderLayer is nvm.DeepseekV4DecoderLayer
    assert attention.check_cuda_hook_points(nvm) is nvm.DeepseekV4FlashMLAAttention


def test_copied_bodies_match_this_vllm() -> None:
    fingerprints.check(cuda.VLLM_DRIFT, MINOR, decorated_on=DeepseekV4FlashMLAAttention)
    cuda.check_kernel_signatures()


def test_drift_table_is_one_literal_covering_both_versions() -> None:
    table = cuda.VLLM_DRIFT
    fingerprints.validate(table)
    # What build_stub.py reads (without importing vLLM) is the module's table.
    assert fingerprints.read_table(cuda.__file__) == table
    for symbol, (roles, hashes) in table.items():
        assert set(hashes) == {"0.33", "0.34"}, symbol
    copied = fingerprints.symbols(table, MINOR, fingerprints.COPIED)
    fenced = fingerprints.symbols(table, MINOR, fingerprints.FENCED)
    assert not set(copied) & set(fenced)
    assert len(copied) == 12 and len(fenced) == (7 if MINOR == "0.33" else 6)
    # Every override of a vLLM method on the layer and its submodules repeats
    # a body of the table.
    for cls, base in ((PLUGIN, DeepseekV4FlashMLAAttention),
                      (cuda.DSV4CudaIndexer, cuda.DeepseekV4Indexer),
                      (cuda.DSV4CudaCompressor, cuda.DeepseekCompressor)):
        for name in ("forward", "_alloc_attn_out", "_sparse_indexer_and_attn", "_forward_decode",
                     "_q_rope_quant", "_compress_norm_rope_store"):
            if name in cls.__dict__:
                owner = next(k for k in base.__mro__ if name in k.__dict__)
                assert f"{owner.__module__}:{owner.__qualname__}.{name}" in copied, name


def _with_hash(symbol: str, fp: str | None) -> tuple[str, dict[str, str | None]]:
    roles, hashes = cuda.VLLM_DRIFT[symbol]
    return roles, {**hashes, MINOR: fp}


def _assert_drift_fails(monkeypatch: pytest.MonkeyPatch, symbol: str, match: str,
                        fp: str | None = "0" * 16) -> None:
    """``symbol``'s recorded fingerprint changed: building the layer class must raise."""
    monkeypatch.setitem(cuda.VLLM_DRIFT, symbol, _with_hash(symbol, fp))
    cuda._checked.cache_clear()
    try:
        with pytest.raises(hooks.PatchError, match=match):
            cuda.layer_cls()
    finally:
        cuda._checked.cache_clear()


def test_fingerprint_drift_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    symbol = next(iter(cuda.VLLM_DRIFT))
    assert fingerprints.COPIED in cuda.VLLM_DRIFT[symbol][0].split()
    _assert_drift_fails(monkeypatch, symbol, "source changed")


def test_source_body_drift_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CuTe DSL body, fingerprinted from its text (cutlass is not importable).
    (symbol,) = [s for s, (roles, _) in cuda.VLLM_DRIFT.items()
                 if fingerprints.SOURCE in roles.split()]
    _assert_drift_fails(monkeypatch, symbol, "plugin's copy was written against")


def test_missing_version_or_reappearing_symbol_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    symbol = next(iter(cuda.VLLM_DRIFT))
    roles, hashes = cuda.VLLM_DRIFT[symbol]
    monkeypatch.setitem(cuda.VLLM_DRIFT, symbol,
                        (roles, {m: h for m, h in hashes.items() if m != MINOR}))
    cuda._checked.cache_clear()
    try:
        with pytest.raises(hooks.PatchError, match=f"no fingerprint recorded for vLLM {MINOR}"):
            cuda.layer_cls()
    finally:
        cuda._checked.cache_clear()
    monkeypatch.setitem(cuda.VLLM_DRIFT, symbol, (roles, hashes))
    # A symbol recorded as absent in this vLLM that exists after all.
    _assert_drift_fails(monkeypatch, symbol, "written against a vLLM", fp=None)


def test_undecorated_method_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    symbol = fingerprints.symbols(cuda.VLLM_DRIFT, MINOR, fingerprints.DECORATED)[0]
    name = symbol.rsplit(".", 1)[-1]
    monkeypatch.setattr(DeepseekV4FlashMLAAttention, name,
                        inspect.unwrap(getattr(DeepseekV4FlashMLAAttention, name)))
    cuda._checked.cache_clear()
    try:
        with pytest.raises(hooks.PatchError, match="no longer decorated"):
            cuda.layer_cls()
    finally:
        cuda._checked.cache_clear()


def test_kernel_signature_drift_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    mod, qual, params = cuda.KERNEL_SIGNATURES[0]
    monkeypatch.setattr(cuda, "KERNEL_SIGNATURES", ((mod, qual, params + ("extra",)),))
    with pytest.raises(hooks.PatchError, match="signature"):
        cuda.check_kernel_signatures()


def _fake_config(backend: AttentionBackendEnum | None) -> types.SimpleNamespace:
    return types.SimpleNamespace(attention_config=types.SimpleNamespace(backend=backend))


def test_register_on_cuda_installs_the_module_global(simulated_cuda) -> None:
    plugin.register()
    state = plugin.state()
    assert state["platform"] == "cuda"
    assert nvm.DeepseekV4FlashMLAAttention is PLUGIN
    assert attention.installed_attention_layer() is PLUGIN
    assert any(a.endswith("DeepseekV4FlashMLAAttention=DSV4FlashMLAAttention")
               for a in state["applied"])
    # What the model's decoder layers (main, MTP, DSpark) now build:
    assert nvm._select_dsv4_attn_cls(
        _fake_config(AttentionBackendEnum.FLASHMLA_SPARSE_DSV4)) is PLUGIN
    # FlashInfer stays vLLM's.
    assert nvm._select_dsv4_attn_cls(
        _fake_config(AttentionBackendEnum.FLASHINFER_MLA_SPARSE_DSV4)) is not PLUGIN
    # A second call is a no-op.
    applied = list(plugin.state()["applied"])
    plugin.register()
    assert plugin.state()["applied"] == applied
    assert nvm.DeepseekV4FlashMLAAttention is PLUGIN
    # Installing again (another register path) changes nothing either.
    attention.install_attention_layer(PLUGIN, platform="cuda")
    assert nvm.DeepseekV4FlashMLAAttention is PLUGIN


def test_install_fails_closed_on_another_version(simulated_cuda, monkeypatch, caplog) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    seen: list[str] = []
    attention.install_attention_layer(PLUGIN, platform="cuda", on_applied=seen.append,
                                      optional=True)
    assert nvm.DeepseekV4FlashMLAAttention is DeepseekV4FlashMLAAttention
    assert seen and "not installed" in seen[0] and "0.33" in seen[0] and "0.34" in seen[0]
    with pytest.raises(hooks.PatchError, match="0.34"):
        attention.install_attention_layer(PLUGIN, platform="cuda", optional=False)
    assert nvm.DeepseekV4FlashMLAAttention is DeepseekV4FlashMLAAttention


def test_install_fails_closed_when_the_hook_point_differs(simulated_cuda) -> None:
    fake = types.ModuleType(attention.CUDA_MODULE)
    fake.DeepseekV4FlashMLAAttention = DeepseekV4FlashMLAAttention

    def _select_dsv4_attn_cls(vllm_config):  # no longer reads the global
        return DeepseekV4Attention

    fake._select_dsv4_attn_cls = _select_dsv4_attn_cls
    fake.DeepseekV4DecoderLayer = nvm.DeepseekV4DecoderLayer
    with pytest.raises(hooks.PatchError, match="no longer reads the module global"):
        attention.check_cuda_hook_points(fake)


def test_mxfp4_below_sm100_is_a_clear_startup_error(monkeypatch) -> None:
    from vllm.platforms import current_platform

    assert attention_config.mxfp4_arch_error(100, "NVIDIA B200") is None
    assert attention_config.mxfp4_arch_error(103, "NVIDIA B300") is None
    msg = attention_config.mxfp4_arch_error(90, "NVIDIA H200")
    assert "NVIDIA H200" in msg and "9.0" in msg and "'fp8'" in msg and "10.x" in msg
    assert "NVIDIA GeForce RTX 5090" in attention_config.mxfp4_arch_error(
        120, "NVIDIA GeForce RTX 5090")

    cfg = types.SimpleNamespace(attention_config=types.SimpleNamespace(
        resolve_indexer_kv_dtype=lambda default: "mxfp4"))
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True, raising=False)
    monkeypatch.setattr(current_platform, "get_device_capability",
                        lambda device_id=0: types.SimpleNamespace(major=9, minor=0),
                        raising=False)
    monkeypatch.setattr(current_platform, "get_device_name", lambda device_id=0: "NVIDIA H200",
                        raising=False)
    with pytest.raises(ValueError, match="NVIDIA H200"):
        cuda.check_mxfp4_arch(cfg)
    # The layer checks before vLLM builds anything.
    with pytest.raises(ValueError, match="compute capability 9.0"):
        PLUGIN(cfg, prefix="model.layers.2.attn")
    fp8 = types.SimpleNamespace(attention_config=types.SimpleNamespace(
        resolve_indexer_kv_dtype=lambda default: default))
    cuda.check_mxfp4_arch(fp8)  # no error


def test_cpu_only_kernel_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_DSV4_KERNEL=torch / vllm_cpu cannot be honoured by the CUDA layer (it always
    runs vLLM's FlashMLA kernels): refused at construction, before vLLM builds anything,
    instead of being ignored."""
    fp8 = types.SimpleNamespace(attention_config=types.SimpleNamespace(
        resolve_indexer_kv_dtype=lambda default: default))
    for kernel in ("torch", "vllm_cpu"):
        monkeypatch.setenv("VLLM_DSV4_KERNEL", kernel)
        with pytest.raises(ValueError, match=rf"VLLM_DSV4_KERNEL={kernel} selects .* CPU"):
            PLUGIN(fp8, prefix="model.layers.2.attn")
    monkeypatch.setenv("VLLM_DSV4_KERNEL", "auto")
    cuda.check_kernel_setting()  # no error


def test_fenced_control_flow_drift_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fork/join the fences rely on is fingerprinted like the copied bodies.
    symbol = "vllm.utils.multi_stream_utils:execute_in_parallel"
    assert symbol in fingerprints.symbols(cuda.VLLM_DRIFT, MINOR, fingerprints.FENCED)
    _assert_drift_fails(monkeypatch, symbol, "execute_in_parallel")


def test_process_weights_after_loading_takes_no_arguments() -> None:
    # 0.34's loader (finalize_model_weights) calls hook() with no arguments,
    # 0.33's with the model dtype: both reserve the workspace once.
    import torch

    from vllm_dsv4_backend.layer.plan import Dims, build_workspace_config
    from vllm_dsv4_backend.testing.schedule import WIDE_PLAN
    from vllm_dsv4_backend.workspace import WorkspaceManager

    params = inspect.signature(PLUGIN.process_weights_after_loading).parameters
    assert all(p.default is not inspect.Parameter.empty for n, p in params.items()
               if n != "self")
    layer = PLUGIN.__new__(PLUGIN)
    torch.nn.Module.__init__(layer)
    layer.prefix, layer.compress_ratio, layer.indexer, layer.compressor = "l.0", 1, None, None
    dims = Dims(num_local_heads=16, padded_q_heads=64, head_dim=512, index_n_heads=64,
                index_head_dim=128, index_topk=16)
    cfg = build_workspace_config(dims, max_num_batched_tokens=8, indexer_kv_dtype="fp8",
                                 plan=WIDE_PLAN, num_ubatches=1)
    ws = WorkspaceManager(cfg, layers=[], device="cpu")
    layer._dsv4_attach(ws)
    layer.process_weights_after_loading()
    assert ws.reserved
    layer.process_weights_after_loading(torch.bfloat16)  # 0.33's call: idempotent
    assert ws.reserved


@pytest.mark.parametrize("kwargs,want", [
    (dict(enable_dbo=False, ubatch_size=0), 1),
    (dict(enable_dbo=True, ubatch_size=0), 2),
    (dict(enable_dbo=False, ubatch_size=4), 4),
])
def test_micro_batches_from_vllms_parallel_config(kwargs, want) -> None:
    from vllm.config import ParallelConfig

    pc = ParallelConfig.__new__(ParallelConfig)
    for k, v in kwargs.items():
        object.__setattr__(pc, k, v)
    assert cuda.num_ubatches(pc) == want
    assert want == (pc.num_ubatches if pc.use_ubatching else 1)


_LOAD = """
import json, logging, os
records = []
class H(logging.Handler):
    def emit(self, r):
        records.append((r.levelname, r.getMessage()))
for name in ("vllm", "vllm_dsv4_backend"):
    logging.getLogger(name).addHandler(H())
    logging.getLogger(name).propagate = False
from vllm.plugins import load_general_plugins
load_general_plugins()
import vllm_dsv4_backend.plugin as plugin
import vllm.models.deepseek_v4.nvidia.model as nvm
from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention
print(json.dumps({"state": plugin.state(),
                  "errors": sorted({m for lvl, m in records if lvl == "ERROR"}),
                  "layer_is_vllms": nvm.DeepseekV4FlashMLAAttention
                  is DeepseekV4FlashMLAAttention}))
"""


def _load_general_plugins(env: dict[str, str]) -> subprocess.CompletedProcess:
    import os

    full = dict(os.environ, VLLM_TARGET_DEVICE="cpu", **env)
    return subprocess.run([sys.executable, "-c", _LOAD], capture_output=True, text=True,
                          env=full, timeout=300)


def test_vllm_cuda_build_on_the_cpu_platform_stands_aside() -> None:
    # vLLM 0.33 / 0.34 on the CPU platform: the plugin has no layer there;
    # load_general_plugins() returns, one ERROR line names the cause, and a
    # DeepSeek-V4 model gets vLLM's own layer.
    proc = _load_general_plugins({"VLLM_DSV4_ATTN_IMPL": "auto"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["layer_is_vllms"]
    assert r["state"]["stood_aside"]
    lines = [e for e in r["errors"] if "cpu platform" in e]
    assert len(lines) == 1, r["errors"]
    assert f"vLLM {MINOR}.0" in lines[0] and "0.32.x" in lines[0] and "0.34.x" in lines[0]
    # The platform-neutral config hooks stay (use_fp4_indexer_cache keeps parsing).
    assert "attention_config_json" in r["state"]["armed"]
    assert not any(a.startswith("T") for a in r["state"]["armed"])
    # Asked for explicitly, the same combination is a clear startup error.
    proc = _load_general_plugins({"VLLM_DSV4_ATTN_IMPL": "plugin"})
    assert proc.returncode != 0
    assert "RuntimeError" in proc.stderr and "cpu platform" in proc.stderr
    assert "VLLM_DSV4_ATTN_IMPL=plugin" in proc.stderr
