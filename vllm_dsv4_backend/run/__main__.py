# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``python -m vllm_dsv4_backend.run`` = ``vllm-dsv4-run``."""

import sys

from vllm_dsv4_backend.run.cli import main

sys.exit(main())
