# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures the tests/core modules share.

``one_thread`` (module scope): one intra-op thread for the module's tests
(:mod:`tests.support.threads`); a module asks for it with
``pytestmark = pytest.mark.usefixtures("one_thread")``.
"""

from __future__ import annotations

from tests.support.threads import one_thread_fixture

one_thread = one_thread_fixture(autouse=False)
