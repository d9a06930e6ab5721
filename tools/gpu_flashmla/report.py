# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The check's one JSON: written after every step (a timeout keeps what ran), each step
run so that an exception becomes its report instead of a crash."""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["Report"]


class Report:
    def __init__(self, path: str, doc: dict[str, Any]) -> None:
        self.path, self.doc = path, doc

    def write(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def step(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one step; an exception becomes ``{"status": "ERROR", ...}``, never a crash."""
        t0 = time.monotonic()
        print(f"== flashmla check: {name}", flush=True)
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 - every step reports instead of crashing
            res = {"status": "ERROR", "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc(limit=8)}
        res["seconds"] = round(time.monotonic() - t0, 2)
        self.doc["steps"][name] = res
        print(f"   {name}: {res.get('status')} ({res['seconds']} s)"
              + (f" {res['error']}" if "error" in res else ""), flush=True)
        self.write()
        return res
