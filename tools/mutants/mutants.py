# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Lifetime, aliasing and ordering mutants of the CUDA layer and the workspace.

Each mutant is one small edit (``old`` -> ``new``, ``old`` found exactly
once in ``path``) that reintroduces a bug of the class #49236's pool was
reverted for (#52836), or one next to it. ``tools/mutants/run.py`` applies
each to a copy of the repository and runs the checks until one fails (the
mutant is *killed*); ``hint`` names the check expected to kill it, tried
first to keep the run short (the rest follow if it does not).

Checks (see ``run.py``): ``harness:<mode>`` (one harness mode, plugin layer,
``--fail-fast``), ``control:<name>`` (one negative control, which must still
pass: a mutant that breaks the fences makes the fenced run corrupt),
``pytest:<path>`` (in the vLLM 0.34 venv for ``tests/cuda``, else ``.venv``),
``contract:<mode>`` (one harness mode, both layers: the plugin's kernel calls
must equal vLLM's layer's, and the recording stand-ins refuse a call the real
kernel would refuse).
"""

from __future__ import annotations

import dataclasses

LAYER = "vllm_dsv4_backend/layer/cuda.py"
KERNELS = "vllm_dsv4_backend/layer/cuda_kernels.py"
CORE = "vllm_dsv4_backend/layer/core.py"
MANAGER = "vllm_dsv4_backend/workspace/manager.py"
EAGER = "vllm_dsv4_backend/eager.py"


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    bug_class: str
    path: str
    old: str
    new: str
    hint: str


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "indexer-q-no-consumer-stream",
        "a lease's consumer stream never declared (used_on dropped): the next producer "
        "on the aux stream is not fenced behind the default stream's read",
        LAYER,
        "        home = owner._dsv4_home_stream()\n"
        "        if home is not None:\n"
        "            lease.used_on(home)\n",
        "        home = owner._dsv4_home_stream()\n",
        "pytest:tests/cuda/test_layer_streams.py",
    ),
    Mutant(
        "topk-released-before-flashmla",
        "release before the last consumer: the top-k lease goes back before FlashMLA "
        "reads the global indices",
        LAYER,
        "                            is_valid,\n"
        "                        )\n"
        "                    else:\n",
        "                            is_valid,\n"
        "                        )\n"
        "                        stack.close()\n"
        "                    else:\n",
        "harness:sim-eager-debug",
    ),
    Mutant(
        "indexer-q-released-before-indexer",
        "release before the last consumer, across streams: the index q (produced on "
        "aux0) goes back before the indexer on the default stream reads it",
        LAYER,
        "            q_quant = (index_q, index_q_scale) if index_q_scale is not None "
        "else index_q\n",
        "            q_quant = (index_q, index_q_scale) if index_q_scale is not None "
        "else index_q\n"
        "            _step = self._dsv4_current_region()\n"
        "            if _step is not None:\n"
        "                _step.release(\"indexer_q\")\n",
        "harness:sim-eager-debug",
    ),
    Mutant(
        "wrong-micro-batch-slot",
        "micro-batch 1 given micro-batch 0's slots (the step holder ignores the ubatch id)",
        CORE,
        "        return ubatch_id() if self._lookup else 0\n",
        "        return 0\n",
        "harness:sim-eager-yield",
    ),
    Mutant(
        "topk-leased-on-forward-step",
        "a lease taken on a different step at capture than at replay: the eager break's "
        "top-k leased from the forward's step, which is gone at piecewise replay",
        LAYER,
        "                        region = stack.enter_context(\n"
        "                            eager.Region(ws, self.prefix, num_decode_tokens, "
        "core.ubatch_id())\n"
        "                        )\n"
        "                        lease = region.lease(\"topk\")\n"
        "                        global_indices, topk_lens = lease[\"global\"], lease[\"lens\"]\n",
        "                        region = self._dsv4_current_region()\n"
        "                        lease = region.lease(\"topk\")\n"
        "                        global_indices = lease[\"global\"][:num_decode_tokens]\n"
        "                        topk_lens = lease[\"lens\"][:num_decode_tokens]\n",
        "harness:sim-piecewise",
    ),
    Mutant(
        "no-fence",
        "a missing fence: a slot's earlier users are forgotten before the next producer",
        MANAGER,
        "        last = slot.last_streams\n"
        "        if not last:\n"
        "            return\n",
        "        last = ()\n"
        "        if not last:\n"
        "            return\n",
        "control:no_fence",
    ),
    Mutant(
        "fence-on-producer-stream",
        "a fence on the producer's stream only: the event is recorded where the next "
        "producer runs, not after the earlier user",
        MANAGER,
        "            backend.record(ev, s)\n",
        "            backend.record(ev, stream)\n",
        "control:no_fence",
    ),
    Mutant(
        "graph-safe-keeps-cross-capture-fence",
        "a captured wait on an event recorded outside the capture (CUDA refuses it: "
        "capture isolation)",
        KERNELS,
        "        if _is_capturing(stream) != _is_capturing(src):\n",
        "        if False:\n",
        "harness:sim-piecewise-gemm0",
    ),
    Mutant(
        "graph-safe-drops-every-fence",
        "every fence dropped, in a capture and out of one",
        KERNELS,
        "        if _is_capturing(stream) != _is_capturing(src):\n",
        "        if True:\n",
        "control:no_fence",
    ),
    Mutant(
        "indexer-q-aliased",
        "two families carved from the same bytes (the index q of both micro-batches on "
        "the attention output's bytes): #49236's families, disjoint use windows in "
        "program order",
        MANAGER,
        "            bufs = tuple((spec, s.offset + off)\n",
        "            bufs = tuple((spec, (0 if s.family == \"indexer_q\" else s.offset) + off)\n",
        "harness:sim-eager-debug",
    ),
    Mutant(
        "stale-attention-out-view",
        "a stale view: the attention output's first lease view kept and reused by every "
        "later call (micro-batch 1 writes micro-batch 0's bytes, no lease taken)",
        LAYER,
        "        return region.lease(\"q\")[\"out\"]\n",
        "        out = region.lease(\"q\")[\"out\"]\n"
        "        return self.__dict__.setdefault(\"_stale_out\", out)\n",
        "harness:sim-eager-yield",
    ),
    Mutant(
        "short-view",
        "a wrong-length view: one token fewer than the lease was asked for",
        MANAGER,
        "            n = spec.nbytes(num_tokens)\n",
        "            n = spec.nbytes(max(num_tokens - 1, 0))\n",
        "harness:sim-eager",
    ),
    Mutant(
        "double-release",
        "a double release: Region.release leaves the lease in the region, close() "
        "releases it again",
        EAGER,
        "        lease = self._leases.pop(family, None)\n",
        "        lease = self._leases.get(family)\n",
        "harness:sim-eager",
    ),
    Mutant(
        "compressor-scratch-released-before-store",
        "release before the last consumer on one stream: the C128 scratch goes back "
        "between the compress kernel and the store kernel that reads it",
        LAYER,
        "        kernels.c128_store(\n",
        "        region.release(\"compressor\")\n"
        "        kernels.c128_store(\n",
        "harness:sim-eager-debug",
    ),
    Mutant(
        "eager-break-undecorated",
        "the eager break no longer decorated: at piecewise replay the top-k is captured "
        "with frozen addresses and no Python runs",
        LAYER,
        "    @eager_break_during_capture\n"
        "    def _sparse_indexer_and_attn(\n",
        "    def _sparse_indexer_and_attn(\n",
        "pytest:tests/cuda/test_structure.py",
    ),
    # --- issue 39's classes: capture, the caching allocator, lease streams, regions ---
    Mutant(
        "fences-dropped-inside-capture",
        "fences dropped whenever either side is capturing, not only across a capture: "
        "hand-overs inside one graph lose their event",
        KERNELS,
        "        if _is_capturing(stream) != _is_capturing(src):\n",
        "        if _is_capturing(stream) or _is_capturing(src):\n",
        "control:no_fence",
    ),
    Mutant(
        "off-record-stream-omitted",
        "the off policy's record_stream calls removed: the caching allocator hands a "
        "lease's block back to its producer's stream while a consumer still reads it",
        MANAGER,
        "                    backend.record_stream(v, s)\n",
        "                    pass\n",
        "control:no_fence",
    ),
    Mutant(
        "topk-released-only-while-capturing",
        "a release only while a capture is active: outside capture the C4 decode "
        "top-k region is opened and never closed",
        LAYER,
        "                        region = stack.enter_context(\n"
        "                            eager.Region(ws, self.prefix, num_decode_tokens, "
        "core.ubatch_id())\n"
        "                        )\n",
        "                        region = eager.Region(ws, self.prefix, num_decode_tokens,\n"
        "                                              core.ubatch_id()).__enter__()\n"
        "                        if torch.cuda.is_current_stream_capturing():\n"
        "                            stack.callback(region.__exit__, None, None, None)\n",
        "harness:sim-eager",
    ),
    Mutant(
        "home-stream-kept-from-first-forward",
        "a micro-batch's consumer stream kept from an earlier forward: a region opened "
        "on a capture stream declares the stream of the first forward as its consumer",
        CORE,
        "            self._homes[ubatch] = ws.backend.current_stream()\n"
        "            try:\n"
        "                yield region\n"
        "            finally:\n"
        "                self._regions.pop(ubatch, None)\n"
        "                self._homes.pop(ubatch, None)\n",
        "            self._homes.setdefault(ubatch, ws.backend.current_stream())\n"
        "            try:\n"
        "                yield region\n"
        "            finally:\n"
        "                self._regions.pop(ubatch, None)\n",
        "harness:sim-full",
    ),
    Mutant(
        "finished-region-reused-after-step",
        "a finished region kept and reused in the next forward (its leases never "
        "handed back, their fences never taken again)",
        CORE,
        "        with eager.Region(ws, self.layer_name, num_tokens, ubatch) as region:\n",
        "        _kept = globals().setdefault(\"_DSV4_KEPT\", {})\n"
        "        _old = _kept.get((id(self), ubatch))\n"
        "        if _old is None or _old.num_tokens != num_tokens:\n"
        "            _old = _kept[(id(self), ubatch)] = eager.Region(\n"
        "                ws, self.layer_name, num_tokens, ubatch)\n"
        "        with contextlib.nullcontext(_old) as region:\n",
        "harness:sim-serve",
    ),
    # --- the adapter held to vLLM's own kernel calls (contract: the harness's
    # recording stand-ins, both layers in one mode) ---
    Mutant(
        "adapter-c128-compress-undeclared-stream",
        "a real kernel launched by the adapter on a stream no fence knows: the C128 "
        "compress runs on a side stream of its own while the store reads its scratch",
        KERNELS,
        "        _SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL(\n"
        "            state_cache=state_cache, num_actual=num_actual,\n",
        "        try:  # (the CPU reference runs have no streams at all)\n"
        "            side = torch.cuda.stream(torch.cuda.Stream())\n"
        "        except RuntimeError:\n"
        "            import contextlib\n"
        "            side = contextlib.nullcontext()\n"
        "        with side:\n"
        "          _SPARSE_ATTN_COMPRESS_C128_BLOCK8_KERNEL(\n"
        "            state_cache=state_cache, num_actual=num_actual,\n",
        "contract:sim-eager",
    ),
    Mutant(
        "adapter-indexer-q-fp8-not-bytes",
        "adapter contract drift: the CuTe DSL indexer-q kernel given the e4m3 tensor "
        "instead of the uint8 bytes vLLM's wrapper passes",
        KERNELS,
        "dict(q_fp8=q_fp8.view(torch.uint8), weights_out=weights_out)",
        "dict(q_fp8=q_fp8, weights_out=weights_out)",
        "contract:sim-eager-cutedsl",
    ),
    Mutant(
        "adapter-c128-store-argument-dropped",
        "adapter contract drift: an argument of the real kernel's signature left out "
        "(rope_head_dim), which the real kernel object refuses",
        KERNELS,
        "            compress_ratio=compress_ratio, head_dim=head_dim, "
        "rope_head_dim=rope_head_dim,\n",
        "            compress_ratio=compress_ratio, head_dim=head_dim,\n",
        "contract:eager",
    ),
    Mutant(
        "adapter-compressor-scratch-strided",
        "adapter contract drift: the C128 scratch handed to the kernels with a "
        "transposed stride (the same bytes, read out of place by the kernel)",
        LAYER,
        '        compressed_kv = lease["scratch"][:num_actual]\n',
        '        compressed_kv = (lease["scratch"].view(-1)[: num_actual * self.head_dim]\n'
        '                         .view(self.head_dim, num_actual).t())\n',
        "contract:eager",
    ),
    Mutant(
        "adapter-flashmla-out-layout",
        "adapter contract drift: FlashMLA's out given as (b, H, 1, 512) instead of "
        "(b, 1, H, 512)",
        LAYER,
        "                out=output.unsqueeze(1),\n",
        "                out=output.unsqueeze(2),\n",
        "contract:eager",
    ),
)
