#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's test command: sets up .venv if anything is missing, then runs
# the whole suite (core, real-vLLM engine/server, lm_eval; GPU tests skip on CPU).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/core -k mxfp4`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
exec .venv/bin/python -m pytest -ra "${@:-tests}"
