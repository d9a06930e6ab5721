# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One intra-op thread for tests of many small ops (torch only).

On a shared 2-core box every tiny op pays an OpenMP barrier when other processes
hold the cores (10-20x slower); the results do not depend on the thread count.
:func:`one_thread` is the context manager; :func:`one_thread_fixture` makes the
module-scoped fixture of that name (``tests/core/conftest.py`` binds one; a test
module binds its own autouse one by importing it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch


@contextlib.contextmanager
def one_thread() -> Iterator[int]:
    """One intra-op thread inside the block; yields the count it restores after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield n
    finally:
        torch.set_num_threads(n)


def one_thread_fixture(*, autouse: bool) -> Callable[..., Any]:
    """A module-scoped ``one_thread`` fixture (``autouse``: for every test of the
    module that binds it)."""

    @pytest.fixture(scope="module", autouse=autouse, name="one_thread")
    def _one_thread() -> Iterator[None]:
        with one_thread():
            yield

    return _one_thread
