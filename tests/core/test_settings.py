# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``envs.py`` is the one reader of ``VLLM_DSV4_*``: a bad value of any setting
raises the same error from envs and from every torch-only reader (the layer
core's workspace maker, step counters, test hooks), and no other module reads them."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.support.families import small_workspace_config
from vllm_dsv4_backend import envs, testing
from vllm_dsv4_backend.layer.core import make_workspace
from vllm_dsv4_backend.workspace import POLICIES, WorkspaceConfig, WorkspaceManager

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_dsv4_backend"

# One malformed value per setting. A path setting has no malformed value.
BAD: dict[str, str] = {
    "VLLM_DSV4_WORKSPACE": "pool",
    "VLLM_DSV4_WORKSPACE_DEBUG": "maybe",
    "VLLM_DSV4_WORKSPACE_LOG_EVERY": "often",
    "VLLM_DSV4_KERNEL": "bogus",
    "VLLM_DSV4_ATTN_IMPL": "both",
    "VLLM_DSV4_SKIP_VERSION_CHECK": "maybe",
    "VLLM_DSV4_DUMMY_INIT": "sometimes",
    "VLLM_DSV4_METRICS": "sometimes",
    "VLLM_DSV4_TEST_UNSAFE_NO_FENCES": "maybe",
    "VLLM_DSV4_TEST_PERTURB_SINK": "a lot",
    "VLLM_DSV4_TEST_ORACLE_FAULT": "topk_plus_two",
}
PATHS = {"VLLM_DSV4_MARKER_DIR", "VLLM_DSV4_METRICS_DIR"}


def _config() -> WorkspaceConfig:
    return small_workspace_config(heads=4, head_dim=64, index_topk=16, tokens=8, indexer="fp8",
                                  ratios=(0, 4))


def _sink_layer() -> Any:
    return SimpleNamespace(prefix="model.layers.0.attn", attn_sink=torch.zeros(4))


# The torch-only readers of each setting (the vLLM glue's readers, plugin.py,
# version.py, loader.py and layer/cpu.py (VLLM_DSV4_KERNEL), call the same envs
# attributes; tests/vllm covers them). The workspace manager takes its policy
# and debug switch as arguments: the layer core's make_workspace reads them.
READERS: dict[str, list[Any]] = {
    "VLLM_DSV4_WORKSPACE": [lambda: make_workspace(_config(), device="cpu")],
    "VLLM_DSV4_WORKSPACE_DEBUG": [lambda: make_workspace(_config(), device="cpu")],
    "VLLM_DSV4_WORKSPACE_LOG_EVERY": [
        lambda: __import__("vllm_dsv4_backend.layer.core", fromlist=["core"]).RegionHolder(
            WorkspaceManager(_config(), policy="shared", debug=False), "layers.0"),
    ],
    "VLLM_DSV4_TEST_UNSAFE_NO_FENCES": [lambda: testing.fences_enabled()],
    "VLLM_DSV4_TEST_PERTURB_SINK": [lambda: testing.after_layer_loaded(_sink_layer())],
    "VLLM_DSV4_TEST_ORACLE_FAULT": [
        lambda: testing.compress_lag(),
        lambda: testing.oracle_fault_topk(torch.zeros(1, 4, dtype=torch.int32),
                                          torch.zeros(1, dtype=torch.int64), 4),
    ],
}


def test_every_setting_has_a_bad_value_here() -> None:
    # A new setting must be added to BAD (or PATHS), so its reader is checked.
    assert set(BAD) | PATHS == set(envs.environment_variables)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_value_same_error_everywhere(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, BAD[name])
    with pytest.raises(ValueError) as from_envs:
        getattr(envs, name)
    message = str(from_envs.value)
    assert message.startswith(f"{name}: ") and repr(BAD[name]) in message
    for read in READERS.get(name, []):
        with pytest.raises(ValueError) as from_reader:
            read()
        assert str(from_reader.value) == message


def test_workspace_debug_maybe_is_not_silently_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # The defect of issue 10: the manager once read "maybe" as off.
    monkeypatch.setenv("VLLM_DSV4_WORKSPACE_DEBUG", "maybe")
    with pytest.raises(ValueError, match="VLLM_DSV4_WORKSPACE_DEBUG: expected 0 or 1"):
        make_workspace(_config(), device="cpu")
    # The manager takes its arguments only: the setting is not read.
    assert WorkspaceManager(_config(), policy="shared", debug=False).debug is False
    assert WorkspaceManager(_config()).debug is False


def test_explicit_arguments_override_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_DSV4_WORKSPACE", "off")
    assert WorkspaceManager(_config(), policy="private", debug=False).policy == "private"
    assert WorkspaceManager(_config()).policy == "shared"


def test_choices_agree_with_envs(monkeypatch: pytest.MonkeyPatch) -> None:
    # The explicit-argument checks and the settings accept the same values.
    for policy in POLICIES:
        monkeypatch.setenv("VLLM_DSV4_WORKSPACE", policy)
        assert policy == envs.VLLM_DSV4_WORKSPACE


def _environ_reads(path: Path) -> list[int]:
    """Lines of ``path`` that read ``os.environ`` / ``os.getenv`` for a
    ``VLLM_DSV4_*`` name (a literal, or one of the name constants)."""
    tree = ast.parse(path.read_text(), str(path))
    hits: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            is_env = (f.attr in ("get", "pop", "setdefault") and _is_environ(f.value)) or (
                f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os")
            key = node.args[0] if node.args else None
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            is_env, key = True, node.slice
        elif isinstance(node, ast.Compare) and any(
                _is_environ(c) for c in node.comparators):
            is_env, key = True, node.left
        else:
            continue
        if is_env and key is not None and _names_setting(key):
            hits.append(node.lineno)
    return hits


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def _names_setting(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.startswith("VLLM_DSV4_")
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name in ("KERNEL_ENV", "ENV_POLICY", "ENV_DEBUG")


# Files still switching a setting through os.environ, with the change that
# removes them. Strict: an entry that no longer offends must be dropped.
PENDING: dict[str, str] = {}


def test_envs_is_the_only_reader() -> None:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "envs.py":
            continue
        lines = _environ_reads(path)
        if lines:
            found[rel] = lines
    unexpected = {k: v for k, v in found.items() if k not in PENDING}
    assert unexpected == {}, f"os.environ use of VLLM_DSV4_* outside envs.py: {unexpected}"
    fixed = sorted(set(PENDING) - set(found))
    assert not fixed, f"{fixed} no longer touch os.environ: drop them from PENDING"
