# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Real FlashMLA sparse decode on a lent GPU whose image has torch but no vLLM.

- :mod:`.bundle` (here, before): copies vLLM's compiled ``_flashmla_C.abi3.so`` and its
  Python interface into a carry bundle (``.scratch/gpu_bundle/flashmla``), the interface
  rewired to load the ``.so`` from the bundle instead of ``import vllm._flashmla_C``;
  ``verify_bundle`` checks a bundle (sizes, hashes, no vLLM import left).
- :mod:`.cases` (torch + the plugin only): DeepSeek-V4 decode inputs built as vLLM 0.34
  builds them (SWA / C4A / C128A metadata through the plugin's ports of vLLM's metadata
  kernels, the 584 B ``fp8_ds_mla`` caches) and the comparison rule.
- :mod:`.check` (on the box; ``--dry-run`` here): loads the ``.so`` and reports whether it
  loads on the box's torch, then runs :mod:`.runs` (FlashMLA eagerly, under a CUDA graph
  and on a side stream against the plugin's serial torch reference) and :mod:`.sanitizer`
  (the same under ``TORCH_CUDA_SANITIZER=1``, plus a no-fence control); writes one JSON
  (:mod:`.report`).
"""
