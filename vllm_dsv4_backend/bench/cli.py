# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""usage: vllm-dsv4-bench [COMMAND] [ARGS ...]

The plugin's served layer against vLLM's own (each needs vLLM), and the kernel benchmark:

  step-ab        whole engine steps, alternating sides step by step in one engine (the
                 default: without a COMMAND, ARGS go to step-ab)
  layer-ab       repeated forwards of each layer, both classes on the same inputs:
                 bitwise equality and allocations
  e2e-layers     both layers served side by side, alternating rounds of requests
  solo-identity  both layers served: concurrent outputs against each one's solo run
  kernels        the torch sparse MLA vs vLLM's C++ CPU kernel and the two-GEMM floor

`vllm-dsv4-bench COMMAND --help` lists a command's flags; docs/benchmarks.md says what each
measures, its JSON keys, and the figures recorded so far.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = {
    "step-ab": "vllm_dsv4_backend.bench.step_ab",
    "layer-ab": "vllm_dsv4_backend.bench.layer_ab",
    "e2e-layers": "vllm_dsv4_backend.bench.e2e_layers",
    "solo-identity": "vllm_dsv4_backend.bench.solo_identity",
    "kernels": "vllm_dsv4_backend.bench.kernels",
}
DEFAULT = "step-ab"


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: run ``COMMAND`` (default ``step-ab``) with the rest of
    ``argv``; returns its exit code (2: an unknown command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if argv and argv[0] in SUBCOMMANDS:
        name = argv.pop(0)
    elif argv and not argv[0].startswith("-"):
        print(f"vllm-dsv4-bench: unknown command {argv[0]!r} (one of "
              f"{', '.join(SUBCOMMANDS)}; --help)", file=sys.stderr)
        return 2
    else:
        name = DEFAULT
    # argparse names the program after argv[0]: usage lines then read
    # "vllm-dsv4-bench layer-ab ...".
    prog, sys.argv[0] = sys.argv[0], f"vllm-dsv4-bench {name}"
    try:
        rc = importlib.import_module(SUBCOMMANDS[name]).main(argv)
    finally:
        sys.argv[0] = prog
    return rc if isinstance(rc, int) else 0  # kernels returns its result


if __name__ == "__main__":
    sys.exit(main())
