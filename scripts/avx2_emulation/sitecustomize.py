# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Make this Python process see an AVX2-only x86 CPU (tests and benchmarks only).

``scripts/as_avx2.sh`` puts this directory first on ``PYTHONPATH``, so every Python
process of the command (pytest, ``vllm serve`` and its engine-core and worker processes,
``vllm bench serve``) runs it at startup. It answers False to the ``torch.cpu`` ISA probes
that vLLM 0.32 (``CpuPlatform.import_kernels``, its attention / linear / MoE selection) and
this plugin (``ops.vllm_cpu.load``) consult. vLLM then loads its AVX2 library
``_C_AVX2.abi3.so``, which lacks the DeepSeek-V4 C++ ops, and the plugin registers its
torch fallbacks under their names, as on an AVX2 machine. The script also caps torch's
own kernels, oneDNN and MKL at AVX2 (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``,
``MKL_ENABLE_INSTRUCTIONS``).

It is an emulation, not an AVX2 machine: clocks, caches and memory bandwidth stay this
machine's, so its timings are indicative; what it settles is which code paths run.
"""

import torch.cpu

_PROBES = (
    "_is_avx512_supported",
    "_is_avx512_vnni_supported",
    "_is_avx512_bf16_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
)


def _absent() -> bool:
    return False


for _name in _PROBES:
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, _absent)
