# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Offline loaders for the smoke tasks: the JSONL data ships next to this file.

lm_eval's ``dataset_path: json`` resolves ``data_files`` against the current
directory, so the tasks would only work when lm_eval runs from the repo root.
A ``custom_dataset`` callable (resolved by ``!function`` relative to the task
YAML) finds the files from ``__file__`` instead, and never touches the Hub.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"

# dataset name -> {split: file}
_DATASETS: dict[str, dict[str, str]] = {
    "arith": {"test": "arith_test.jsonl", "fewshot": "arith_fewshot.jsonl"},
    "choice": {"test": "choice_test.jsonl"},
}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file; a blank or malformed line raises ValueError with its number."""
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from e
    return rows


def load_smoke_dataset(name: str | None = None, **_: Any):
    """Return a ``datasets.DatasetDict`` for smoke dataset ``name`` ("arith" | "choice").

    lm_eval calls ``custom_dataset(**metadata, **dataset_kwargs)``; extra keys
    (``version`` ...) are ignored.
    """
    import datasets

    if name not in _DATASETS:
        raise ValueError(f"dataset_kwargs.name: expected one of {sorted(_DATASETS)}, got {name!r}")
    return datasets.DatasetDict(
        {
            split: datasets.Dataset.from_list(read_jsonl(DATA_DIR / fname))
            for split, fname in _DATASETS[name].items()
        }
    )
