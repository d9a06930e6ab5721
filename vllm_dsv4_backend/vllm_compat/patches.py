# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The registry of the plugin's patches of vLLM: one entry per patch.

Each :class:`Patch` says why it exists, how it patches, the upstream code it
replaces and when it can be removed, and goes through one mechanism:

* **armed, not applied**: :func:`arm` (called by ``plugin.register()`` in
  every vLLM process) registers a post-import hook
  (:func:`hooks.when_imported`) per target module, so a patch runs right
  after vLLM itself imports that module, in whichever process does;
  ``armed=False`` entries are applied on demand by the code named in
  ``applied_by`` (:func:`apply`);
* **checked**: every install function checks its hook point first
  (:func:`hooks.check_signature` / :func:`hooks.check_accepts_keyword`, or a
  probe) and raises :class:`~vllm_dsv4_backend.vllm_compat.hooks.PatchError`
  naming the vLLM version and symbol when vLLM changed it;
* **never breaks vLLM**: whatever an install raises (a ``PatchError``, or an
  ``AttributeError`` / ``TypeError`` from a vLLM that moved something), every
  attribute the patch set, in any of its modules, is put back
  (:func:`hooks.set_attr` / :func:`hooks.undo`), its other modules are left
  alone, and one ERROR line names the patch; vLLM's own code serves. Only
  ``strict`` (``VLLM_DSV4_ATTN_IMPL=plugin``) raises, a ``PatchError`` naming
  the patch, out of the import of the patched module (a startup error);
* **idempotent**: the replacement carries the one marker
  :func:`hooks.mark_port`; an install that finds it does nothing;
* **observable**: each replacement is reported (``on_applied``; the plugin's
  marker JSON lists them) and :func:`applied` names the entries applied in
  this process.

``python -m vllm_dsv4_backend.vllm_compat.patches`` prints the table. Nothing
here imports vLLM at module level.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_dsv4_backend._logging import init_logger
from vllm_dsv4_backend.vllm_compat import (
    attention,
    attention_config,
    collectives,
    guards,
    hooks,
    kernels,
    loader,
    pipeline,
)

__all__ = ["PATCHES", "Patch", "applied", "apply", "arm", "describe", "failed"]

logger = init_logger(__name__)

Report = Callable[[str], None]
"""Called with a short description (``"T1:vllm....compute_token_to_req_indices"``)
for every replacement an install makes, in the process that makes it."""

REGISTER = "plugin.register() (armed: applied when vLLM imports the module)"


@dataclass(frozen=True)
class Patch:
    """One runtime patch of vLLM."""

    name: str
    why: str
    how: str
    upstream: str
    """The vLLM code it replaces or wraps (file: symbol)."""
    remove_when: str
    modules: tuple[str, ...]
    """The vLLM modules it patches; each one's import applies it there."""
    install: Callable[[ModuleType, Report], bool] | None
    """Patches one of ``modules``; True if it changed something, False if the
    patch was already in place (or is not needed). None: applied elsewhere
    (``applied_by``), listed here so every patch is in one table."""
    platforms: tuple[str, ...] = ("cpu", "cuda")
    armed: bool = True
    """Armed by ``plugin.register()``; False: applied on demand by ``applied_by``."""
    applied_by: str = REGISTER
    reached: bool = True
    """False: vLLM's path on the listed platforms never calls the patched code
    (ported anyway, so a future vLLM that does gets correct values)."""


_lock = threading.RLock()
_applied: list[str] = []
# Per entry, every attribute it set so far (all its modules), to undo them all
# when one install fails; and the entries that failed (never retried).
_records: dict[str, hooks.Record] = {}
_failed: dict[str, str] = {}
_report: Report | None = None  # the reporter of the last arm() (the plugin's marker)


def _noop(_desc: str) -> None:
    return None


# --------------------------------------------------------------------------------------------
# install functions defined here (the others live next to the code they patch in)
# --------------------------------------------------------------------------------------------
def _mxfp4_indexer_cache(dsv4_attention: ModuleType, on_applied: Report) -> bool:
    mla_indexer = importlib.import_module("vllm.v1.attention.backends.mla.indexer")
    original = mla_indexer.dsa_indexer_uses_fp4
    if hooks.is_port(original):
        return False
    hooks.check_signature(
        "vllm.v1.attention.backends.mla.indexer.dsa_indexer_uses_fp4", original, ("vllm_config",)
    )
    hooks.resolve(dsv4_attention, "dsa_indexer_uses_fp4")

    def dsa_indexer_uses_fp4(vllm_config: Any) -> bool:
        if vllm_config.attention_config.resolve_indexer_kv_dtype("fp8") == "mxfp4":
            return True
        return original(vllm_config)

    dsa_indexer_uses_fp4.__vllm_dsv4_original__ = original  # type: ignore[attr-defined]
    port = hooks.mark_port(dsa_indexer_uses_fp4)
    hooks.set_attr(mla_indexer, "dsa_indexer_uses_fp4", port)
    # The DeepSeek-V4 attention module imported the function by name.
    hooks.set_attr(dsv4_attention, "dsa_indexer_uses_fp4", port)
    on_applied("mxfp4:vllm.v1.attention.backends.mla.indexer.dsa_indexer_uses_fp4")
    return True


def _cpu_op_fallbacks(_cpu_model: ModuleType, on_applied: Report) -> bool:
    # Runs on the import of the DeepSeek-V4 CPU model, i.e. after vLLM loaded
    # its kernel library (registering first would make vLLM's own fail).
    from vllm_dsv4_backend.vllm_compat import cpu_ops

    names = cpu_ops.register_missing()
    if names:
        on_applied(f"cpu_ops:{len(names)} torch fallbacks:{','.join(names)}")
    return bool(names)


ROUTER_MODULE = "vllm.model_executor.layers.fused_moe.router.cpu_router"
ROUTER_OPS = ("hash_topk_cpu", "biased_topk_cpu")


def _router_expert_counts(cpu_router: ModuleType, on_applied: Report) -> bool:
    from vllm_dsv4_backend.vllm_compat import cpu_ops

    changed = False
    for name in ROUTER_OPS:
        owner, attr, current = hooks.resolve(cpu_router, name)
        if hooks.is_port(current):
            continue
        hooks.check_signature(
            f"{ROUTER_MODULE}.{name}", current,
            ("gating_output", "tid2eid", "topk", "scoring_func", "num_fused_shared_experts",
             "num_experts", "routed_scaling_factor") if name == "hash_topk_cpu" else
            ("hidden_states", "gating_output", "correction_bias", "topk", "renormalize",
             "scoring_func", "num_fused_shared_experts", "routed_scaling_factor",
             "apply_routed_scaling_factor_on_output"),
        )
        hooks.set_attr(owner, attr,
                       hooks.mark_port(cpu_ops.router_with_shape_fallback(name, current)))
        on_applied(f"router:{ROUTER_MODULE}.{name} serves the shapes its kernel refuses")
        changed = True
    return changed


MOE_EP_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def _moe_expert_map(cpu_moe: ModuleType, on_applied: Report) -> bool:
    from vllm_dsv4_backend.vllm_compat import moe_ep

    owner, attr, current = hooks.resolve(cpu_moe, "CPUUnquantizedExperts.apply")
    if hooks.is_port(current):
        return False
    hooks.check_signature(
        f"{MOE_EP_MODULE}.CPUUnquantizedExperts.apply", current,
        ("output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation",
         "global_num_experts", "expert_map", "a1q_scale", "a2_scale", "workspace13",
         "workspace2", "expert_tokens_meta", "apply_router_weight_on_input"),
    )
    hooks.set_attr(owner, attr, hooks.mark_port(moe_ep.wrap_apply(current)))
    on_applied(f"moe:{MOE_EP_MODULE}.CPUUnquantizedExperts.apply honours expert_map")
    return True


def _kernel_port(key: str) -> Callable[[ModuleType, Report], bool]:
    def install(module: ModuleType, on_applied: Report) -> bool:
        return kernels.install_kernel_port(key, module, on_applied)

    return install


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------
_MLA = "vllm/v1/attention/backends/mla"
_TRITON_WHY = (
    "vLLM 0.32's CPU DeepSeek-V4 metadata builders launch this Triton kernel, which has no "
    "CPU backend without triton-cpu (not on PyPI)"
)
_TRITON_REMOVE = "vLLM's CPU metadata builders stop launching Triton kernels"
_KERNEL_WHY = {
    "T1": _TRITON_WHY + "; read on every CPU step.",
    "T2": _TRITON_WHY + "; read on every CPU step.",
    "T3": _TRITON_WHY + "; read for sequences longer than 2051 tokens.",
    "T4": _TRITON_WHY + "; not read on CPU in 0.32.",
    "T5": _TRITON_WHY + "; not read on CPU in 0.32.",
    "T6": _TRITON_WHY + "; read only with DSpark.",
    "T7": _TRITON_WHY + "; not reached on CPU in 0.32.",
    "T8": _TRITON_WHY + "; not reached on CPU in 0.32.",
}
_UNREAD = {"T4", "T5", "T7", "T8"}


def _kernel_entry(key: str) -> Patch:
    rows = kernels.kernel_rows(key)
    targets = ", ".join(f"{r.module}.{r.attr}" for r in rows)
    port = rows[0].port
    return Patch(
        name=key,
        why=_KERNEL_WHY[key],
        how=f"replaces {targets} with the torch port "
        f"vllm_dsv4_backend.ops.metadata.{port} "
        f"({'wrapped in TorchKernel' if rows[0].wrap else 'a plain function'}), after checking "
        "the launcher's parameter names",
        upstream=targets,
        remove_when=_TRITON_REMOVE,
        modules=tuple(dict.fromkeys(r.module for r in rows)),
        install=_kernel_port(key),
        platforms=("cpu",),
        reached=key not in _UNREAD,
    )


def _legacy_key_entry(name: str, *, why: str, how: str, upstream: str,
                      install: Callable[[ModuleType, Report], bool]) -> Patch:
    # The three use_fp4_indexer_cache hooks: armed where vLLM parses its config.
    return Patch(name=name, why=why, how=how, upstream=upstream,
                 remove_when="the published serve commands use indexer_kv_dtype",
                 modules=("vllm.engine.arg_utils",), install=install)


PATCHES: dict[str, Patch] = {
    p.name: p
    for p in (
        *(_kernel_entry(k) for k in dict.fromkeys(r.key for r in kernels.KERNEL_PATCHES)),
        Patch(
            name="B1",
            why="vLLM 0.32 bug: DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler "
            "returns only the swaonly/c4a/c128a keys while the shared build() also reads "
            "c1a/c2a (KeyError: 'c1a' on the first CPU step), with or without Triton.",
            how="replaces the method with one returning every _LAYER_TYPE_* key as None "
            "(CPU never plans FlashMLA tiles); skipped when the installed method already "
            "returns them all",
            upstream=f"vllm/models/deepseek_v4/cpu/cpu_mla.py: {kernels.B1_SYMBOL}",
            remove_when="vLLM's CPU builder returns every layer-type key (then the probe "
            "skips it already)",
            modules=(kernels.B1_MODULE,),
            install=kernels.fix_b1_tile_scheduler,
            platforms=("cpu",),
        ),
        Patch(
            name="cpu_op_fallbacks",
            why="Only vLLM's AVX512-BF16 _C library has the DeepSeek-V4 C++ ops; on other "
            "CPUs vLLM's own DeepSeek-V4 CPU model stops at its first _C call.",
            how="defines, in torch.ops._C, a torch implementation with the C++ schema for "
            "each op the loaded library lacks (vllm_compat.cpu_ops.register_missing); ops the "
            "library has are never touched; the marker is the op's __vllm_dsv4_fallback__",
            upstream="csrc/cpu/sgl-kernels (torch.ops._C.*_cpu DeepSeek-V4 ops)",
            remove_when="vLLM's AVX2/AVX512 CPU libraries carry the DeepSeek-V4 ops",
            modules=(attention.CPU_MODULE,),
            install=_cpu_op_fallbacks,
            platforms=("cpu",),
        ),
        Patch(
            name="router_expert_counts",
            why="vLLM 0.32's AVX512-BF16 routing kernels (hash_topk_cpu, biased_topk_cpu, "
            "SGLang ports) take only DeepSeek's expert counts (64 or more); a DeepSeek-V4 "
            "with fewer routed experts (the trained tiny model: 4, top 2) stops at its first "
            "step with RuntimeError 'unsupported num_experts'.",
            how="wraps the two names in cpu_router: vLLM's kernel for every shape it takes "
            "(unchanged, bitwise); for a shape it refuses (its 'unsupported' error, raised "
            "before it computes), the torch op of vllm_compat.cpu_ops, with one WARNING per "
            "shape",
            upstream=f"{ROUTER_MODULE.replace('.', '/')}.py: hash_topk_cpu, biased_topk_cpu "
            "(csrc/cpu/sgl-kernels/topk.cpp)",
            remove_when="vLLM's CPU routing kernels take any expert count",
            modules=(ROUTER_MODULE,),
            install=_router_expert_counts,
            platforms=("cpu",),
        ),
        Patch(
            name="moe_expert_map",
            why="Under --enable-expert-parallel vLLM 0.32's CPU experts ignore expert_map and "
            "pass global expert ids to cpu_fused_moe, which indexes past the rank's local "
            "weights: the worker dies with SIGSEGV on the first request (the seed's TP 2 + EP "
            "command line).",
            how="wraps CPUUnquantizedExperts.apply: with an expert_map, global ids become "
            "local slots and another rank's experts get weight 0 (moe_ep.local_expert_ids), "
            "as every other vLLM experts backend reads expert_map; without one, unchanged",
            upstream="vllm/model_executor/layers/fused_moe/experts/cpu_moe.py: "
            "CPUUnquantizedExperts.apply",
            remove_when="vLLM's CPU unquantized experts honour expert_map",
            modules=(MOE_EP_MODULE,),
            install=_moe_expert_map,
            platforms=("cpu",),
        ),
        Patch(
            name="dummy_init_loader",
            why="vLLM's --load-format dummy weights give every token logprob -ln(vocab): a "
            "tiny model cannot tell a right attention from a wrong one. The vllm_dsv4_dummy_init "
            "marker in a model's config.json asks for seeded fan-in weights instead.",
            how="wraps DummyModelLoader.load_weights: vLLM's dummy init, then "
            "vllm_dsv4_backend.vllm_compat.dummy_init through the parameters' own weight "
            "loaders, only for models carrying the marker (VLLM_DSV4_DUMMY_INIT=0 turns it off)",
            upstream="vllm/model_executor/model_loader/dummy_loader.py: "
            f"{loader.LOADER_SYMBOL}",
            remove_when="never needed by serving; remove with the tiny test model",
            modules=(loader.LOADER_MODULE,),
            install=loader.install,
        ),
        _legacy_key_entry(
            "attention_config_json",
            why="vLLM >= 0.32 rejects --attention-config '{\"use_fp4_indexer_cache\": true}' "
            "(the spelling of every published DeepSeek-V4 serve command) at argument parsing.",
            how="wraps arg_utils._expand_json_human_readable_numbers, which every "
            "--attention-config JSON passes through right before pydantic validates it: "
            "use_fp4_indexer_cache true/false becomes indexer_kv_dtype mxfp4/fp8, a "
            "contradiction with an explicit indexer_kv_dtype is a clear error",
            upstream="vllm/engine/arg_utils.py: _expand_json_human_readable_numbers",
            install=attention_config.install_json_hook,
        ),
        _legacy_key_entry(
            "attention_config_init",
            why="the same legacy key through Python: AttentionConfig(use_fp4_indexer_cache=...).",
            how="wraps AttentionConfig.__init__ to map the keyword like the JSON hook "
            "(armed on arg_utils, which imports the config module)",
            upstream="vllm/config/attention.py: AttentionConfig.__init__",
            install=attention_config.install_init_hook,
        ),
        _legacy_key_entry(
            "llm_attention_config",
            why="LLM(attention_config={'use_fp4_indexer_cache': ...}) filters the dict through "
            "is_init_field() and raises before AttentionConfig sees it.",
            how="wraps LLM.__init__ to map the key; only where vllm.entrypoints.llm is already "
            "imported when arg_utils is (callers that loaded plugins themselves)",
            upstream="vllm/entrypoints/llm.py: LLM.__init__",
            install=attention_config.install_llm_hook,
        ),
        Patch(
            name="architecture_check",
            why="vLLM's CPU platform silently ignores --attention-backend FLASHMLA_SPARSE_DSV4 "
            "for other models, and a CUDA build would build a generic layer on a "
            "DeepSeek-V4-only backend: the user gets a clear startup error instead.",
            how="wraps EngineArgs.create_engine_config: after vLLM builds the config, "
            "guards.check_architecture refuses the backend for non-DeepSeek-V4 architectures "
            "(DeepSeek-V4.1: one line, vLLM's own layer), guards.check_settings the flags it "
            "cannot honour, guards.check_executor the Ray executor on a platform without a Ray "
            "device key (vLLM 0.32's CPU platform: refused for DeepSeek-V4, a warning otherwise)",
            upstream="vllm/engine/arg_utils.py: EngineArgs.create_engine_config",
            remove_when="vLLM validates a backend against the model architecture",
            modules=("vllm.engine.arg_utils",),
            install=guards.install_hook,
        ),
        Patch(
            name="mxfp4_indexer_cache",
            why="vLLM refuses indexer_kv_dtype='mxfp4' off Blackwell ('requires Blackwell "
            "datacenter GPUs') because its MXFP4 indexer kernels are DeepGEMM's; the "
            "plugin's CPU layer computes MXFP4 logits and stores in torch.",
            how="wraps dsa_indexer_uses_fp4 in vllm.v1.attention.backends.mla.indexer and "
            "its by-name import in vllm.models.deepseek_v4.attention: True for mxfp4, "
            "vLLM's answer otherwise (other validation stays vLLM's)",
            upstream=f"{_MLA}/indexer.py: dsa_indexer_uses_fp4",
            remove_when="vLLM's CPU path supports the MXFP4 indexer cache",
            modules=("vllm.models.deepseek_v4.attention",),
            install=_mxfp4_indexer_cache,
            platforms=("cpu",),
            armed=False,
            applied_by="vllm_dsv4_backend.layer.cpu.layer_cls() (only with the plugin's layer)",
        ),
        Patch(
            name="swa_unread_kernels",
            why="vLLM 0.32's CPU SWA metadata builder runs two kernels (T4 window index "
            "tables, T5 prefill gather lengths) whose outputs no CPU DeepSeek-V4 layer reads "
            "(both build their window tables from the positions in forward_mqa): time spent "
            "on every step for nothing.",
            how="the plugin's SWA builder (backend.DSV4CPUSWAMetadataBuilder.build) binds "
            "sparse_swa's two kernel globals to a no-op for the duration of vLLM's build() "
            "and restores them after (builds run on the engine's one model-runner thread); "
            "the fields they fill are set to None so a later reader fails loudly; checked at "
            "first use (the globals and fields must exist)",
            upstream="vllm/v1/attention/backends/mla/sparse_swa.py: "
            "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL, _COMPUTE_PREFILL_METADATA_KERNEL",
            remove_when="vLLM's CPU SWA builder skips the GPU-only window tables itself",
            modules=("vllm.v1.attention.backends.mla.sparse_swa",),
            install=None,
            platforms=("cpu",),
            armed=False,
            applied_by="vllm_dsv4_backend.backend.get_swa_builder_cls() (each CPU SWA "
            "metadata build, only with the plugin's backend)",
        ),
        Patch(
            name="attention_layer",
            why="DeepSeek-V4 picks its attention layer class in the model, not through the "
            "attention-backend registry, so serving the plugin's layer means swapping that "
            "class.",
            how="rebinds the model module's global layer class to the plugin's subclass: CPU "
            "DeepseekV4CPUAttention of cpu/model.py; CUDA (0.33 only) "
            "DeepseekV4FlashMLAAttention of nvidia/model.py, which _select_dsv4_attn_cls "
            "reads at call time (attention.check_cuda_hook_points checks that first); the "
            "layer checks the fingerprints of the vLLM bodies it repeats "
            "(vllm_compat.fingerprints) when it is built",
            upstream="vllm/models/deepseek_v4/cpu/model.py: DeepseekV4CPUAttention; "
            "vllm/models/deepseek_v4/nvidia/model.py: DeepseekV4FlashMLAAttention",
            remove_when="vLLM's own layer takes output buffers from a workspace",
            modules=(attention.CPU_MODULE, attention.CUDA_MODULE),
            install=None,
            armed=False,
            applied_by="plugin.register() per VLLM_DSV4_ATTN_IMPL, through "
            "vllm_compat.attention.install_attention_layer (which arms its own import hook)",
        ),
        Patch(
            name="sleep_mode_workspace_pool",
            why="Under --enable-sleep-mode vLLM 0.33/0.34 allocate their own workspace in the "
            "cuMem pool tagged 'workspace' (scratch: unmapped without a host copy on sleep, "
            "mapped back at the same addresses on wake-up); the plugin's reservation, made "
            "while the model loads, would land in the 'weights' pool and be copied to host "
            "memory on every sleep like a weight (RL frameworks sleep vLLM between rollouts).",
            how="replaces nothing: the workspace reserves inside the context vLLM's own "
            "workspace manager allocates in (current_workspace_manager()._alloc_context(), the "
            "GPU worker's _maybe_get_memory_pool_context('workspace'): the pool under sleep "
            "mode, a null context without the cuMem allocator and on CPU), after checking "
            "init_workspace_manager / WorkspaceManager take alloc_context; no vLLM manager: "
            "a plain reservation (vllm_compat.sleep_mode.reservation_context)",
            upstream="vllm/v1/worker/workspace.py: WorkspaceManager._alloc_context; "
            "vllm/v1/worker/gpu_worker.py: Worker._init_workspace_and_model_runner",
            remove_when="the plugin's buffers are leased from vLLM's own workspace manager",
            modules=("vllm.v1.worker.workspace",),
            install=None,
            armed=False,
            applied_by="vllm_dsv4_backend.layer.core.reserve_and_report (each model's "
            "reservation, through vllm_compat.sleep_mode.reservation_context)",
        ),
        Patch(
            name="pp_stage_kv_cache",
            why="Under --pipeline-parallel-size vLLM 0.32 gives a stage a KV cache tensor for "
            "another stage's layer when a KV cache group (a UniformTypeKVCacheSpecs) has none "
            "of its layers: the projected group keeps the whole model's spec, whose layers "
            "get_kv_cache_config_from_groups lays out; allocate_kv_cache then dies with "
            "StopIteration (DeepSeek-V4, any attention layer: its C128 compressor-state group "
            "is on one stage only).",
            how="wraps kv_cache_utils.get_kv_cache_config_from_groups: drops the tensors whose "
            "layers are on none of the stage's groups (pipeline.own_layer_tensors); offsets, "
            "bytes per block and block counts already come from the groups' layer names; a "
            "config without such a tensor is returned unchanged",
            upstream="vllm/v1/core/kv_cache_utils.py: get_kv_cache_config_from_groups "
            "(with _project_kv_cache_groups_to_worker)",
            remove_when="vLLM lays out group.layer_names (0.34's kv_cache_planning does; 0.33's "
            "still lays out the spec's layers, so a CUDA PP stage on 0.33 would need it too)",
            modules=(pipeline.KV_CACHE_MODULE,),
            install=pipeline.install_stage_kv_cache,
            platforms=("cpu",),
        ),
        Patch(
            name="pp_intermediate_buffer",
            why="Under --pipeline-parallel-size a later stage copies the hidden states it "
            "receives into GPUModelRunner.intermediate_tensors, which only _dummy_run "
            "allocates; vLLM 0.32's CPU worker runs no dummy step under --enforce-eager with "
            "an explicit KV cache size (VLLM_CPU_KVCACHE_SPACE), so the first request fails "
            "'assert self.intermediate_tensors is not None' on stage 1 (any model).",
            how="wraps GPUModelRunner.sync_and_gather_intermediate_tensors (CPUModelRunner's "
            "base; armed on CPU only): allocates the buffer as _dummy_run does "
            "(model.make_empty_intermediate_tensors(max_num_tokens, model dtype, device)) when "
            "it is missing, then vLLM's method",
            upstream="vllm/v1/worker/gpu_model_runner.py: "
            "GPUModelRunner.sync_and_gather_intermediate_tensors (inherited by "
            "vllm/v1/worker/cpu_model_runner.py: CPUModelRunner)",
            remove_when="vLLM's CPU runner allocates the intermediate tensors without a "
            "warm-up step",
            modules=(pipeline.RUNNER_MODULE,),
            install=pipeline.install_intermediate_buffer,
            platforms=("cpu",),
        ),
        Patch(
            name="dp_collectives",
            why="Under --data-parallel-size vLLM 0.32 runs the MoE across the DP ranks through "
            "the allgather_reducescatter all2all manager, which calls all_gatherv and "
            "reduce_scatterv; CpuCommunicator inherits both from DeviceCommunicatorBase, where "
            "they raise NotImplementedError: the server starts, every request returns HTTP 500.",
            how="replaces DeviceCommunicatorBase.all_gatherv / reduce_scatterv (both raise "
            "NotImplementedError; communicators with their own keep theirs) with gloo "
            "collectives on the communicator's device_group: all_gather of rows padded to the "
            "largest rank's count, all_reduce then this rank's rows "
            "(vllm_compat.collectives)",
            upstream="vllm/distributed/device_communicators/base_device_communicator.py: "
            "DeviceCommunicatorBase.all_gatherv, DeviceCommunicatorBase.reduce_scatterv "
            "(inherited by cpu_communicator.py: CpuCommunicator)",
            remove_when="vLLM's CpuCommunicator implements all_gatherv and reduce_scatterv",
            modules=(collectives.COMM_MODULE,),
            install=collectives.install,
            platforms=("cpu",),
        ),
    )
}


# --------------------------------------------------------------------------------------------
# mechanism
# --------------------------------------------------------------------------------------------
def _get(name: str) -> Patch:
    patch = PATCHES.get(name)
    if patch is None:
        raise ValueError(f"patch: expected one of {sorted(PATCHES)}, got {name!r}")
    return patch


def _install(patch: Patch, module: ModuleType, on_applied: Report, strict: bool = True) -> bool:
    assert patch.install is not None
    with _lock:
        if patch.name in _failed:
            # A half-applied patch is worse than none: its other modules keep vLLM's code.
            if strict:
                raise hooks.PatchError(f"vllm_dsv4_backend patch {patch.name} failed earlier "
                                       f"in this process ({_failed[patch.name]})")
            return False
        record = _records.setdefault(patch.name, [])
    try:
        with hooks.recording(record):
            changed = patch.install(module, on_applied)
    except Exception as e:  # noqa: BLE001 - whatever a patch raises, vLLM must keep working
        # A hook point that differs from the vLLM the patch was read from (a
        # patch release), or a bug: vLLM's own objects go back in every module.
        with _lock:
            hooks.undo(record)
            _failed[patch.name] = f"{type(e).__name__}: {e}"
            if patch.name in _applied:
                _applied.remove(patch.name)
        err = hooks.patch_failed(patch.name, module.__name__, e, strict=strict)
        on_applied(f"{patch.name}: not applied, vLLM's code kept ({err})")
        if strict:
            raise err from e
        return False
    if changed:
        with _lock:
            if patch.name not in _applied:
                _applied.append(patch.name)
        logger.debug("vllm_dsv4_backend: applied patch %s in %s", patch.name, module.__name__)
    return changed


NEUTRAL = ("cpu", "cuda")
"""``platforms`` of the entries that patch only vLLM's platform-neutral config
code (armed even where the plugin has no layer for the platform)."""


def arm(
    platform: str,
    on_applied: Report | None = None,
    *,
    strict: bool = True,
    neutral_only: bool = False,
) -> list[str]:
    """Arm every ``armed`` entry for ``platform`` (post-import hooks); return their names.

    Cheap: imports nothing. ``on_applied`` is kept for :func:`apply` calls
    without a reporter (the entries applied on demand report to the same
    marker). On CPU it also arms the completeness check: once vLLM imports
    the DeepSeek-V4 CPU model, every CPU port's module must have been
    imported (else its Triton kernel was not replaced).

    Args:
        strict: a hook point that differs raises ``PatchError`` when vLLM
            imports the module (``VLLM_DSV4_ATTN_IMPL=plugin``); False logs
            an ERROR and keeps vLLM's code (the default serving mode).
        neutral_only: arm only the platform-neutral config entries (a vLLM
            the plugin knows, on a platform it has no layer for).
    """
    global _report
    report = on_applied or _noop
    _report = report
    names: list[str] = []
    for patch in PATCHES.values():
        if not patch.armed or patch.install is None or platform not in patch.platforms:
            continue
        if neutral_only and patch.platforms != NEUTRAL:
            continue
        for module in patch.modules:
            hooks.when_imported(
                module, lambda m, p=patch: _install(p, m, report, strict))
        names.append(patch.name)
        if patch.name == "B1":
            # Before the fallbacks (same trigger module): the order register() always had.
            _arm_completeness_check(strict)
    return names


def _arm_completeness_check(strict: bool = True) -> None:
    ported = kernels.kernel_modules()

    def check(_module: ModuleType) -> None:
        missing = [m for m in hooks.pending() if m in ported]
        if missing:
            err = hooks.fail(
                attention.CPU_MODULE,
                f"the DeepSeek-V4 CPU model was imported but the patched modules {missing} "
                "were not, so their Triton kernels were not replaced",
            )
            if strict:
                raise err
            logger.error("vllm_dsv4_backend: %s", err)

    hooks.when_imported(attention.CPU_MODULE, check)


def apply(name: str, on_applied: Report | None = None) -> bool:
    """Apply entry ``name`` now, importing its modules (idempotent).

    True if it changed vLLM. ``on_applied`` defaults to the reporter of the
    last :func:`arm` (the plugin's marker), so on-demand patches are listed
    with the armed ones.
    """
    patch = _get(name)
    if patch.install is None:
        raise ValueError(f"patch {name!r} is applied by {patch.applied_by}, not by apply()")
    report = on_applied or _report or _noop
    changed = False
    for module_name in patch.modules:
        changed |= _install(patch, importlib.import_module(module_name), report)
    return changed


def applied() -> list[str]:
    """Names of the entries this process applied (changed vLLM), in order."""
    with _lock:
        return list(_applied)


def failed() -> dict[str, str]:
    """The entries whose install failed in this process (undone): name -> cause."""
    with _lock:
        return dict(_failed)


def describe() -> str:
    """The registry as text: per entry why, how, upstream, when to remove."""
    out: list[str] = []
    for p in PATCHES.values():
        flags = [f"platforms {', '.join(p.platforms)}", f"applied by {p.applied_by}"]
        if not p.reached:
            flags.append("not read by vLLM's path today")
        out += [
            f"{p.name} ({'; '.join(flags)})",
            f"  why:         {p.why}",
            f"  how:         {p.how}",
            f"  upstream:    {p.upstream}",
            f"  remove when: {p.remove_when}",
        ]
    return "\n".join(out)


if __name__ == "__main__":  # pragma: no cover
    print(describe())
