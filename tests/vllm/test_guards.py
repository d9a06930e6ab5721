# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FLASHMLA_SPARSE_DSV4 on a non-DeepSeek-V4 model is a clear startup error
(vLLM's CPU platform would otherwise silently serve it with CPU_ATTN)."""

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
TINY_DSV4 = ROOT / "configs" / "tiny-dsv4"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-llama")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (TINY_DSV4 / f).exists():
            shutil.copy(TINY_DSV4 / f, d / f)
    vocab = json.loads((TINY_DSV4 / "config.json").read_text())["vocab_size"]
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    }))
    return d


def _engine_config(model: Path, backend: str | None, **extra):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dsv4_backend.vllm_compat import patches

    patches.apply("architecture_check")
    kwargs = {"attention_backend": backend} if backend else {}
    kwargs.update(extra)
    return EngineArgs(model=str(model), load_format="dummy", tokenizer_mode="hf",
                      max_model_len=256, enforce_eager=True, **kwargs).create_engine_config()


def test_non_dsv4_model_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="serves only DeepSeek-V4.*LlamaForCausalLM"):
        _engine_config(tiny_llama, "FLASHMLA_SPARSE_DSV4")


def test_other_models_without_the_flag_are_untouched(tiny_llama):
    cfg = _engine_config(tiny_llama, None)
    assert cfg.model_config.architectures == ["LlamaForCausalLM"]


def test_dsv4_with_the_flag_passes():
    cfg = _engine_config(TINY_DSV4, "FLASHMLA_SPARSE_DSV4")
    assert cfg.attention_config.backend.name == "FLASHMLA_SPARSE_DSV4"


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp8_ds_mla"])
def test_dsv4_supported_kv_cache_dtypes_pass(kv_dtype):
    cfg = _engine_config(TINY_DSV4, "FLASHMLA_SPARSE_DSV4", kv_cache_dtype=kv_dtype,
                         block_size=256)
    assert cfg.cache_config.block_size == 256


def test_dsv4_other_kv_cache_dtype_is_refused():
    # vLLM alone accepts fp8_e5m2 and serves; the backend only has the fp8_ds_mla layout.
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8_e5m2.*'auto', 'fp8', 'fp8_ds_mla'"):
        _engine_config(TINY_DSV4, "FLASHMLA_SPARSE_DSV4", kv_cache_dtype="fp8_e5m2")


def test_dsv4_other_block_size_is_refused():
    # vLLM's CPU platform would override 128 with 256 and only warn.
    with pytest.raises(ValueError, match=r"--block-size 128.*256"):
        _engine_config(TINY_DSV4, "FLASHMLA_SPARSE_DSV4", block_size=128)


def test_dsv4_tp_size_with_unfit_per_rank_shapes_is_refused(tmp_path):
    # vLLM checks the heads itself; the grouped wo_a is ours: 1 output group over 2 ranks
    # is refused at config time with the sizes that work, not at load or first request.
    model = tmp_path / "tiny-one-group"
    shutil.copytree(TINY_DSV4, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["o_groups"] = 1
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2: .*o_groups 1 / 2 = 0.5 per "
                                         r"rank.*sizes that work for this model: \[1\]"):
        _engine_config(model, "FLASHMLA_SPARSE_DSV4", tensor_parallel_size=2)


def _stub_config(archs: list[str], backend: str = "FLASHMLA_SPARSE_DSV4"):
    from types import SimpleNamespace

    hf = SimpleNamespace(**json.loads((TINY_DSV4 / "config.json").read_text()))
    return SimpleNamespace(
        attention_config=SimpleNamespace(backend=SimpleNamespace(name=backend)),
        model_config=SimpleNamespace(model="m", architectures=archs, hf_config=hf),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, enable_expert_parallel=False),
    )


def test_dsv4_vision_variant_with_the_flag_passes():
    # vLLM 0.33/0.34 build DeepseekV4ForConditionalGeneration's language model with
    # init_vllm_registered_model(..., "DeepseekV4ForCausalLM"): the plugin's layer serves
    # it. (vLLM's CPU build only has a stub for the vision class, so no engine here.)
    from vllm_dsv4_backend.vllm_compat import guards

    cfg = _stub_config(["DeepseekV4ForConditionalGeneration"])
    guards.check_architecture(cfg)
    guards.check_settings(type("A", (), {"kv_cache_dtype": "auto", "block_size": None})(), cfg)
    # The settings checks still apply to it: a bad block size is refused, not skipped.
    with pytest.raises(ValueError, match=r"--block-size 128"):
        guards.check_settings(type("A", (), {"kv_cache_dtype": "auto", "block_size": 128})(),
                              cfg)


# DeepseekV41ForCausalLM is not refused: vLLM serves it with V4.1's own layer and the
# plugin stands aside with one line (issue 41; tests/cuda/test_cross_layer_buffers.py).
@pytest.mark.parametrize("archs", [["DeepseekV3ForCausalLM"], ["LlamaForCausalLM"], []])
def test_non_dsv4_architectures_are_still_refused(archs):
    from vllm_dsv4_backend.vllm_compat import guards

    with pytest.raises(ValueError, match=r"serves only DeepSeek-V4 \(architectures "
                                         r"\['DeepseekV4ForCausalLM', "
                                         r"'DeepseekV4ForConditionalGeneration'\]\)"):
        guards.check_architecture(_stub_config(archs))


def test_ray_executor_on_cpu_is_refused_at_startup_with_the_reason(caplog, monkeypatch):
    """vLLM 0.32's CPU platform cannot run ``--distributed-executor-backend ray`` (issue 41,
    docs/parallel.md): the plugin says why when vLLM builds the engine config, before a Ray
    cluster is started (a ValueError for DeepSeek-V4 on the backend, a WARNING otherwise)."""
    import inspect
    import logging

    from vllm.platforms import current_platform
    from vllm.v1.executor import ray_utils

    from vllm_dsv4_backend.vllm_compat import guards

    # The vLLM facts the message states.
    assert current_platform.is_cpu() and current_platform.ray_device_key == ""
    src = inspect.getsource(ray_utils.initialize_ray_cluster)
    assert "ray_device_key" in src and "does not support ray." in src
    cfg = _stub_config(["DeepseekV4ForCausalLM"])
    guards.check_executor(cfg)  # no Ray: nothing to say
    cfg.parallel_config.distributed_executor_backend = "ray"
    with pytest.raises(ValueError, match=r"cannot run the Ray executor .*ray_device_key is "
                                         r"empty.*'current platform cpu does not support ray\.'"):
        guards.check_executor(cfg)
    monkeypatch.setattr(guards, "_ray_warned", [])
    other = _stub_config(["LlamaForCausalLM"], backend="CPU_ATTN")
    other.parallel_config.distributed_executor_backend = "ray"
    with caplog.at_level(logging.WARNING, logger="vllm_dsv4_backend"):
        guards.check_executor(other)  # other models: one line, vLLM decides
        guards.check_executor(other)
    # (a record forwarded to vLLM's handlers may reach caplog twice: count distinct ones)
    lines = {(r.getMessage(), r.created) for r in caplog.records
             if "cannot run the Ray executor" in r.getMessage()}
    assert len(lines) == 1, lines
    # A platform with a Ray device key (CUDA's "GPU") is left alone.
    assert guards.ray_problem(type("P", (), {"ray_device_key": "GPU"})()) is None
