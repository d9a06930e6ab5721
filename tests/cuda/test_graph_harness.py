# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CUDA-graph harness (tools/cuda_graph) against this environment's vLLM.

The installed vLLM's DeepSeek-V4 control flow is cut into a stand-in package
(``build_stub.py``, into a temporary folder), and the harness drives the
plugin's unmodified CUDA layer and vLLM's own through it, in a subprocess
(the stand-in ``vllm`` must be the first on the path, and this process may
have imported the real one). Every CPU mode must match its serial reference
bit for bit, the plugin's output must equal vLLM's, and both negative
controls must be detected. CUDA modes run too when this machine has CUDA.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _vllm_minor() -> str | None:
    try:
        v = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None
    minor = ".".join(v.split(".")[:2])
    return minor if minor in ("0.33", "0.34") else None


pytestmark = pytest.mark.skipif(_vllm_minor() is None,
                                reason="needs vLLM 0.33 or 0.34 installed (.venv-vllm033/034)")


def _run_harness(tmp_path: Path) -> tuple[str, dict]:
    from tools.cuda_graph import build_stub

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    stub = tmp_path / "stub"
    version, cuts = build_stub.build(Path(spec.origin).parent.parent, stub)
    assert version.startswith(_vllm_minor() + ".")
    names = {sym for sym, *_ in cuts}
    assert "vllm.models.deepseek_v4.attention:DeepseekV4Attention._sparse_indexer_and_attn" \
        in names
    assert "vllm.v1.worker.ubatching (whole file)" in names  # vLLM's micro-batch threads

    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=f"{stub}{os.pathsep}{REPO}", PYTHONDONTWRITEBYTECODE="1")
    env.pop("VLLM_DSV4_TEST_UNSAFE_NO_FENCES", None)
    p = subprocess.run([sys.executable, str(REPO / "tools" / "cuda_graph" / "harness.py"),
                        "--steps", "2", "--json", str(out)], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=3600)
    report = json.loads(out.read_text()) if out.exists() else {}
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert report["stub"].startswith(str(stub))  # the stand-in shadowed the installed vLLM
    return version, report


@pytest.fixture(scope="module")
def harness_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    return _run_harness(tmp_path_factory.mktemp("harness"))


def test_harness_cpu_modes_bitwise_and_controls(harness_report: tuple[str, dict]) -> None:
    version, report = harness_report
    assert report["ok"] is True
    assert report["vllm"] == version
    assert report["plugin_equals_vllm_cpu"] is True
    modes = report["modes"]
    assert {"eager", "private"} <= set(modes)
    for mode, entry in modes.items():
        for impl, res in entry.items():
            assert res["bitwise_equal"], (mode, impl, res)
    # 2 micro-batches x (7 q.out + 3 C4 x (indexer_q + topk) + 2 C128 compressor).
    assert modes["eager"]["plugin"]["leases_per_step"] == [30, 30]
    saved = [v - p for v, p in zip(modes["eager"]["vllm"]["allocations_per_step"],
                                   modes["eager"]["plugin"]["allocations_per_step"])]
    assert saved == [42, 42]  # the same 2 x 21 tensors, allocated by vLLM's layer
    controls = report["controls"]
    assert controls["wrong_standin_topk_off_by_one"]["detected"] is True
    assert controls["no_fence_schedule_cpu"]["detected"] is True


# Every kernel object the adapter calls, with the FP8 indexer and the Triton or
# the CuTe DSL dispatch (sim-eager-cutedsl).
ADAPTER_KERNELS = {"_COMPUTE_GLOBAL_TOPK_INDICES_AND_LENS_KERNEL",
                   "_SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL",
                   "_SPARSE_ATTN_NORM_ROPE_STORE_KERNEL", "flash_mla_with_kvcache"}


def test_adapter_calls_equal_vllm_layer_calls(harness_report: tuple[str, dict]) -> None:
    """The plugin's layer runs the adapter serving runs (``VllmCudaKernels``)
    against recording stand-ins of vLLM's kernel objects bound to the real
    signatures; per mode, its calls equal vLLM's layer's: the same kernels, order,
    streams and tensor metadata, but for the workspace's storages."""
    _, report = harness_report
    both = report["contract"]
    # Every mode both layers ran (private runs the plugin's only).
    assert set(both) == {m for m, e in report["modes"].items() if "vllm" in e}
    version = report["vllm"]
    assert {"eager", "sim-eager", "sim-piecewise", "sim-full", "sim-serve"} <= set(both)
    if version.startswith("0.34."):
        assert {"sim-eager-cutedsl", "sim-serve-mxfp4"} <= set(both)
    for name, c in both.items():
        assert c["diff"] == [], (name, c["diff"])
        n_plugin, n_vllm = c["kernel_calls"]
        assert n_plugin == n_vllm > 0, name
        assert set(c["kernels"]) >= ADAPTER_KERNELS, name
    assert "_FUSED_INDEXER_Q_ROPE_QUANT_TRITON_KERNEL" in both["sim-eager"]["kernels"]
    if "sim-eager-cutedsl" in both:
        assert "_INDEXER_Q_FP8_KERNEL" in both["sim-eager-cutedsl"]["kernels"]



# The emulated modes each version's default run must hold (tools/cuda_graph/modes.py:
# Mode.versions; --extended runs the rest): 0.33 the modes its own control flow changes,
# 0.34 every default mode.
SIM_MODES = {
    "0.33": ("sim-eager", "sim-eager-yield", "sim-piecewise", "sim-full", "sim-serve",
             "sim-serve-mrv1"),
    "0.34": ("sim-eager", "sim-eager-yield", "sim-eager-debug", "sim-eager-cutedsl",
             "sim-off", "sim-piecewise", "sim-piecewise-debug", "sim-piecewise-gemm0",
             "sim-full", "sim-stage", "sim-serve", "sim-serve-mxfp4"),
}


def test_emulated_cuda_modes_race_free_and_bitwise(harness_report: tuple[str, dict]) -> None:
    """vLLM's streams, events, graphs and micro-batch threads emulated on CPU
    (tools/cuda_graph/simcuda.py), a happens-before race detector watching
    (races.py): every mode bitwise equal to its serial reference, no race."""
    version, report = harness_report
    modes = report["modes"]
    want = set(SIM_MODES[_vllm_minor()])
    assert want <= set(modes)
    assert report["race_detector"]["self_check"]["ok"] is True
    for name in want:
        for impl, res in modes[name].items():
            assert res["bitwise_equal"], (name, impl)
            # Capture-time eager code included; and no workspace access on a stream
            # its lease never declared.
            assert res["races"]["races"] == 0, (name, impl, res["races"]["first"])
            assert res["races"]["races_in_capture"] == 0
            assert res["races"]["undeclared_stream_accesses"] == 0, res["races"]
            # PyTorch's caching allocator modelled: blocks freed and reused.
            assert res["emulator"]["allocator"]["reused"] > 0, (name, impl)
    plugin = {name: modes[name]["plugin"] for name in want}
    for name in ("sim-piecewise", "sim-full"):
        assert plugin[name]["emulator"]["allocator"]["graph_pool_allocations"] > 0, name
    assert plugin["sim-eager"]["leases_per_step"] == [30, 30]
    assert plugin["sim-piecewise"]["leases_per_step"] == [6, 6]  # the C4 top-k only
    assert plugin["sim-full"]["leases_per_step"] == [0, 0]
    # The captured work really replays; the eager break runs at replay.
    for name in ("sim-piecewise", "sim-full"):
        emu = plugin[name]["emulator"]
        assert emu["captured_launches"] > 0 and emu["replayed_launches"] > 0, emu
    assert all(n > 0 for n in plugin["sim-piecewise"]["eager_breaks"])
    # Micro-batches interleave in vLLM's UBatchContext threads.
    for name in {"sim-eager", "sim-eager-yield", "sim-full", "sim-stage"} & want:
        assert plugin[name]["micro_batches"]["interleaved"] is True, name
    if "sim-off" not in want:
        return
    # `off`: every lease a block of the allocator model, consumers' streams recorded;
    # the blocks come back only after those streams pass the free.
    alloc = plugin["sim-off"]["emulator"]["allocator"]
    assert alloc["record_stream"] > 0 and alloc["reused_after_recorded_streams"] > 0, alloc
    # GraphSafeCudaStreamBackend drops the cross-capture fences, and only those.
    assert plugin["sim-piecewise-gemm0"]["fences_dropped"] > 0
    # A pipeline stage reserves and leases only its own layers.
    stage = plugin["sim-stage"]
    assert stage["workspace_layers"] == [f"model.layers.{i}.attn" for i in (3, 4, 5, 6)]
    assert stage["first_layer"] == "model.layers.3.attn"
    assert stage["leases_per_step"] == [18, 18]
    assert stage["model_steps_counted"] == 2  # marked at the stage's own first layer


SERVE_MODES = {"0.33": ("sim-serve", "sim-serve-mrv1"), "0.34": ("sim-serve", "sim-serve-mxfp4")}


def test_serving_schedule_one_workspace(harness_report: tuple[str, dict]) -> None:
    """A served process (tools/cuda_graph/serve.py): FULL replays of decode
    batches, breakable PIECEWISE replays of mixed batches and eager steps above
    the largest capture size, micro-batches on and off, interleaved in one model
    over one workspace and one graph pool; FP8 and MXFP4 (0.34) indexers; 0.33's MRV1
    too. Every step bitwise equal to the serial reference, no race (capture
    included), each step's leases what the lease plan says, and the adapter's
    calls equal vLLM's layer's."""
    version, report = harness_report
    modes = report["modes"]
    want = set(SERVE_MODES[_vllm_minor()])
    assert want <= set(modes)
    steps = report["serve"]["schedule"]
    # Every kind, with micro-batches on and off, and every transition between kinds.
    kinds = [s.split(":")[0] for s in steps]
    assert {"full", "full+dbo", "piecewise", "piecewise+dbo", "eager", "eager+dbo"} <= set(kinds)
    pairs = {(a.split("+")[0], b.split("+")[0]) for a, b in zip(kinds, kinds[1:])}
    assert {(a, b) for a in ("full", "piecewise", "eager")
            for b in ("full", "piecewise", "eager") if a != b} <= pairs
    for name in want:
        for impl, res in modes[name].items():
            assert res["bitwise_equal"], (name, impl)
            assert res["races"]["races"] == 0, (name, impl, res["races"]["first"])
            assert res["leases_as_expected"], (name, impl, res["leases_per_step"])
            assert res["steps"] == steps
        plugin = modes[name]["plugin"]
        # Eager steps lease every family, PIECEWISE replays the eager break's, FULL none.
        for kind, n in zip(kinds, plugin["leases_per_step"]):
            assert (n == 0) == kind.startswith("full"), (kind, n)
        assert plugin["graphs"]["full"] >= 2 and plugin["graphs"]["piecewise"] >= 2
        assert report["contract"][name]["diff"] == []
    if "sim-serve-mxfp4" not in want:
        return
    mx = report["contract"]["sim-serve-mxfp4"]["kernels"]
    assert "_FUSED_INDEXER_Q_ROPE_MXFP4_TRITON_KERNEL" in mx
    assert "_FUSED_INDEXER_Q_ROPE_QUANT_TRITON_KERNEL" not in mx


def test_vllm_fork_join_capture_code_ran(harness_report: tuple[str, dict]) -> None:
    """Every key line of vLLM's fork / join / eager break / capture / hand-over
    bodies ran (line coverage over every thread)."""
    _, report = harness_report
    assert report["coverage_all_key_lines_hit"] is True, report["coverage_missed"]
    for body, r in report["coverage"].items():
        assert r["lines_hit"] > 0, body


def test_no_join_control_and_emulated_no_fence_control(harness_report: tuple[str, dict]
                                                       ) -> None:
    """Negative controls on the emulator: vLLM's execute_in_parallel without its
    join is reported by the race detector; the workspace without fences, over
    the plugin's GraphSafeCudaStreamBackend, corrupts and races."""
    _, report = harness_report
    controls = report["controls"]
    assert controls["no_join_execute_in_parallel"]["detected"] is True
    assert controls["no_join_execute_in_parallel"]["races"] > 0
    sim = controls["no_fence_schedule_sim"]
    assert sim["detected"] is True
    for order in ("lazy", "random"):
        assert sim[order]["races_with_fences"] == 0
        assert sim[order]["mismatches_with_fences"] == 0
        assert sim[order]["races_without_fences"] > 0  # counted up to the saturation
    # The off policy without record_stream, and the fan-out captured in one graph
    # without fences: both race; with them, clean.
    for part, good, bad in (("off", "with_record_stream", "without_record_stream"),
                            ("captured", "with_fences", "without_fences")):
        assert sim[part][good] == {"mismatches": 0, "races": 0}, (part, sim[part])
        assert sim[part][bad]["races"] > 0, (part, sim[part])
