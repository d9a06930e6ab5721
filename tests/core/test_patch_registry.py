# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The patch registry (torch only: nothing here imports vLLM): every entry is
complete, listed where a newcomer reads, and the files that patch vLLM use
the registry's one marker instead of ad-hoc flags."""

from __future__ import annotations

from pathlib import Path

import pytest

import vllm_dsv4_backend.vllm_compat as vllm_compat
from vllm_dsv4_backend.vllm_compat import kernels, patches

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_dsv4_backend"


def test_docstring_lists_every_patch() -> None:
    doc = vllm_compat.__doc__ or ""
    missing = [name for name in patches.PATCHES if f"``{name}``" not in doc]
    assert missing == [], f"vllm_compat/__init__.py's docstring does not list {missing}"


@pytest.mark.parametrize("name", sorted(patches.PATCHES))
def test_every_entry_is_complete(name: str) -> None:
    p = patches.PATCHES[name]
    assert p.name == name
    for field in ("why", "how", "upstream", "remove_when", "applied_by"):
        assert len(getattr(p, field).strip()) > 10, f"{name}.{field} is empty"
    assert p.modules and all(m.startswith("vllm.") for m in p.modules)
    assert set(p.platforms) <= {"cpu", "cuda"} and p.platforms
    # Applied elsewhere only when it says by whom.
    if p.install is None or not p.armed:
        assert p.applied_by != patches.REGISTER


def test_kernel_table_and_registry_agree() -> None:
    keys = list(dict.fromkeys(r.key for r in kernels.KERNEL_PATCHES))
    assert keys == [f"T{i}" for i in range(1, 9)]
    for key in keys:
        assert set(patches.PATCHES[key].modules) == {r.module for r in kernels.kernel_rows(key)}
    # The ports vLLM 0.32's CPU path does not read are marked.
    assert {k for k in keys if not patches.PATCHES[k].reached} == {"T4", "T5", "T7", "T8"}


def test_describe_names_every_entry() -> None:
    text = patches.describe()
    for name in patches.PATCHES:
        assert f"\n{name} (" in f"\n{text}"


def test_apply_unknown_or_external_is_an_error() -> None:
    with pytest.raises(ValueError, match="patch: expected one of"):
        patches.apply("nope")
    with pytest.raises(ValueError, match="install_attention_layer"):
        patches.apply("attention_layer")


def test_one_idempotency_marker() -> None:
    # The registry's marker (hooks.mark_port) is the only one.
    offenders = [
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
        if "_dsv4_patched" in p.read_text()
    ]
    assert offenders == []
