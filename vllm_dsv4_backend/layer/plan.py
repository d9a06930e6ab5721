# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The lease plan: the (family, view) pairs each platform's layer leases from
the workspace, per indexer K cache dtype and layer kind. Data only, declared
next to the layers; :func:`vllm_dsv4_backend.layer.core.lease_plan` turns it
into the ``workspace.sizing.LeasePlan`` sizing reserves exactly, and
``python -m vllm_dsv4_backend.workspace.sizing`` prints its table. Imports
nothing (so the workspace's sizing tool can read it without a circle).
"""

from __future__ import annotations

__all__ = ["LEASE_PLAN"]

# The indexer q: values, MXFP4's ue8m0 scales (FP8 has no scales view, so
# nothing is reserved for it there) and the head weights; written by the
# platform's q-quant kernel on both platforms.
_INDEXER_Q = ("q", "scales", "weights")

# platform -> indexer K cache dtype -> layer kind -> family -> views: what
# each layer really leases (tests/cuda/test_layer_streams.py and
# tests/vllm/test_lease_plan_served.py compare it with the leases taken).
# Neither layer leases ``topk.local``: both write the local ids into vLLM's
# model-wide ``topk_indices_buffer``. Every layer leases ``q.out`` (vLLM's
# per-layer attention output); the padded q comes back from vLLM's fused
# q-norm/RoPE/KV-insert kernel (no output argument) on both platforms.
LEASE_PLAN: dict[str, dict[str, dict[str, dict[str, tuple[str, ...]]]]] = {
    # CPU: topk.global is the page-id output topk_transform_512_cpu must
    # write (FP8) or the plugin's MXFP4 top-k's global ids, with lens; the
    # compressors' state goes to vLLM's caches (no scratch on CPU).
    "cpu": {
        "fp8": {
            "swa": {"q": ("out",)},
            "c4": {"q": ("out",), "indexer_q": _INDEXER_Q, "topk": ("global",)},
            "c128": {"q": ("out",)},
        },
        "mxfp4": {
            "swa": {"q": ("out",)},
            "c4": {"q": ("out",), "indexer_q": _INDEXER_Q, "topk": ("global", "lens")},
            "c128": {"q": ("out",)},
        },
    },
    # CUDA: C4 decode's global top-k and lengths through vLLM's kernel
    # object; C128's compressor fp32 scratch (C4's compressors allocate
    # nothing the plugin replaces).
    "cuda": dict.fromkeys(("fp8", "mxfp4"), {
        "swa": {"q": ("out",)},
        "c4": {"q": ("out",), "indexer_q": _INDEXER_Q, "topk": ("global", "lens")},
        "c128": {"q": ("out",), "compressor": ("scratch",)},
    }),
}
