# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The patch registry (torch only: nothing here imports vLLM): every entry is
complete, listed where a newcomer reads, and the files that patch vLLM use
the registry's one marker instead of ad-hoc flags."""

from __future__ import annotations

import sys
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


def test_a_failing_hook_never_breaks_the_import(tmp_path, monkeypatch) -> None:
    """Any post-import hook (not only the registry's, which catch their own failures):
    whatever it raises is one ERROR line naming it, the import succeeds and the module's
    other hooks run; under VLLM_DSV4_ATTN_IMPL=plugin it is a startup error."""
    import importlib
    import logging

    from vllm_dsv4_backend.vllm_compat import hooks

    monkeypatch.syspath_prepend(str(tmp_path))
    ran: list[str] = []

    def broken_hook(module) -> None:
        raise AttributeError("vLLM renamed something")

    for name in ("dsv4_hooked_a", "dsv4_hooked_b"):
        (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
        monkeypatch.delitem(sys.modules, name, raising=False)
        hooks.when_imported(name, broken_hook)
        hooks.when_imported(name, lambda m: ran.append(m.__name__))

    errors: list[str] = []

    class Errors(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                errors.append(record.getMessage())

    # On the hooks module's own logger: the package logger may not propagate (once
    # attached to vLLM's handlers).
    handler = Errors()
    hooks.logger.addHandler(handler)
    monkeypatch.delenv("VLLM_DSV4_ATTN_IMPL", raising=False)
    try:
        assert importlib.import_module("dsv4_hooked_a").VALUE == 1
    finally:
        hooks.logger.removeHandler(handler)
    assert len(errors) == 1 and "broken_hook" in errors[0], errors
    assert "AttributeError: vLLM renamed something" in errors[0]
    assert ran == ["dsv4_hooked_a"]

    monkeypatch.setenv("VLLM_DSV4_ATTN_IMPL", "plugin")
    with pytest.raises(AttributeError, match="vLLM renamed something"):
        importlib.import_module("dsv4_hooked_b")
    assert "dsv4_hooked_b" not in sys.modules
