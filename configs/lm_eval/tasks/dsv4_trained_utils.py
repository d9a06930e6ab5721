# SPDX-License-Identifier: Apache-2.0
"""Offline loader for the trained tiny model's tasks (``dsv4_kv_far``,
``dsv4_kv_near``, ``dsv4_copy``): the JSONL docs ship in ./data, written by
``scripts/train_tiny_dsv4.py --write-tasks`` (a seed apart from training).

Found from ``__file__`` (lm_eval resolves ``!function`` next to the YAML), so the
tasks run from any directory and never touch the Hub.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
NAMES = ("kv_far", "kv_near", "copy")


def read_docs(name: str) -> list[dict[str, Any]]:
    """The docs of task ``dsv4_<name>`` in file order."""
    if name not in NAMES:
        raise ValueError(f"dataset_kwargs.name: expected one of {NAMES}, got {name!r}")
    path = DATA_DIR / f"trained_{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_trained_dataset(name: str | None = None, **_: Any):
    """A ``datasets.DatasetDict`` with one ``test`` split (lm_eval's ``custom_dataset``)."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(read_docs(str(name)))})
