# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Whatever a patch of the registry raises, vLLM keeps working (the real vLLM 0.32 CPU build).

Every entry of ``vllm_compat.patches.PATCHES`` gets a failure that is not a
``PatchError`` (``AttributeError``, ``TypeError``, ``RuntimeError``, ``KeyError``,
cycled over the entries), then vLLM's patched modules are imported the way vLLM
imports them (the plugin loaded through vLLM's own loader first, so each patch runs
from inside that import):

* ``after``: the entry's real install runs and changes vLLM, then the failure is
  raised: every attribute it changed, in every module, must hold vLLM's object again;
* ``before``: the failure comes before any change.

Each entry must leave exactly one ERROR line naming it, every import must succeed,
no port of the plugin may be left in vLLM, and a DeepSeek-V4 model gets vLLM's own
layer. Under ``VLLM_DSV4_ATTN_IMPL=plugin`` (the explicit request) the same failure
is a ``PatchError`` naming the entry and the cause: out of ``import
vllm.engine.arg_utils`` (what every ``vllm serve`` imports), and for each entry from
its install, with vLLM's objects put back.

The entries vLLM does not reach through an import (``install`` None) are failed
where the plugin applies them (``ELSEWHERE``, in tests.support.patch_failures with the
rest of the injection); a new such entry must be added there (the test says so). The
engine-level checks (a model served with the patches failing, other models untouched by
the plugin) are in ``test_other_models.py``.

This file is also the worker script: ``python test_patch_failures.py imports MODE OUT``
or ``... strict - OUT`` (launched by ``run_script_report``, which makes ``tests``
importable).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

# The injection (vLLM-free on import: this file is also the workers' script).
from tests.support.patch_failures import (
    ELSEWHERE,
    NOT_FAILED,
    capture_errors,
    exception_for,
    failing,
    inject,
    snapshot,
)

# Entries whose real install changes no vLLM attribute in this flow, so "after" can
# only check the failure is caught: the fallbacks register torch ops (none where
# vLLM's library has them all); the LLM hook applies only where LLM was imported
# before arg_utils (test_other_models' engine covers it); the SWA builder is a class.
# sleep_mode_workspace_pool reads vLLM's workspace alloc context and replaces nothing.
CHANGES_NOTHING = frozenset({"cpu_op_fallbacks", "llm_attention_config", "swa_unread_kernels",
                             "sleep_mode_workspace_pool"})


# ----------------------------------------------------------------------------
# worker (a fresh interpreter: patches must not leak into pytest's process)
# ----------------------------------------------------------------------------
def _target_modules() -> list[str]:
    """The modules the registry patches, CUDA's model aside (it does not import on CPU)."""
    from vllm_dsv4_backend.vllm_compat import patches

    return list(dict.fromkeys(m for p in patches.PATCHES.values() for m in p.modules
                              if "nvidia" not in m))


def _not_restored(changed: dict[str, list[tuple[Any, str, Any]]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    missing = object()
    for name, entries in changed.items():
        bad = [f"{getattr(o, '__name__', o)}.{k}" for o, k, v in entries
               if vars(o).get(k, missing) is not v]
        if bad:
            out[name] = bad
    return out


def _imports_worker(mode: str, out_path: str) -> None:
    os.environ["VLLM_DSV4_ATTN_IMPL"] = "auto"
    errors = capture_errors()
    from vllm_dsv4_backend.vllm_compat import hooks, patches

    names = list(patches.PATCHES)
    changed: dict[str, list[tuple[Any, str, Any]]] = {}
    inject(mode, names, changed, elsewhere=False)
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    # vllm_dsv4_backend.layer imports no vLLM: in place before the model's import.
    inject(mode, ["attention_layer"], changed, elsewhere=True)
    import_errors = {}
    for module in _target_modules():
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - the report says which
            import_errors[module] = f"{type(e).__name__}: {e}"
    from vllm.models.deepseek_v4.cpu import cpu_sparse
    from vllm.models.deepseek_v4.cpu import model as cpu_model

    from vllm_dsv4_backend import backend

    inject(mode, [n for n in names if n != "attention_layer"], changed, elsewhere=True)
    swa_cls = backend.get_swa_builder_cls()
    # Each model's workspace reservation reads vLLM's workspace alloc context.
    from vllm_dsv4_backend.vllm_compat import sleep_mode

    with sleep_mode.reservation_context():
        pass
    from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUSparseSWAMetadataBuilder

    def is_port(value: Any) -> bool:
        try:
            return hooks.is_port(value)
        except Exception:  # noqa: BLE001 - vLLM's placeholders for absent packages raise
            return False

    leftover = sorted(f"{getattr(o, '__name__', o)}.{k}" for o, k, v in snapshot().values()
                      if is_port(v))
    report = {
        "names": names,
        "errors": [message for message, _ in errors],
        "import_errors": import_errors,
        "changed": {n: len(v) for n, v in changed.items()},
        "not_restored": _not_restored(changed),
        "leftover_ports": leftover,
        "failed": patches.failed(),
        "layer_is_vllms": cpu_model.DeepseekV4CPUAttention is cpu_sparse.DeepseekV4CPUAttention,
        "swa_builder_is_vllms": swa_cls is DeepseekV4CPUSparseSWAMetadataBuilder,
    }
    Path(out_path).write_text(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)


def _strict_worker(out_path: str) -> None:
    os.environ["VLLM_DSV4_ATTN_IMPL"] = "plugin"
    from vllm_dsv4_backend.vllm_compat import attention, patches

    names = list(patches.PATCHES)
    real = dict(patches.PATCHES)
    # 1. Each entry on plain vLLM modules (no plugin loaded yet), through the
    # registry's own install step, strict as register() arms it under plugin.
    modules = {m: importlib.import_module(m) for m in _target_modules()}
    from vllm.models.deepseek_v4.cpu import cpu_sparse
    from vllm.models.deepseek_v4.cpu import model as cpu_model

    changed: dict[str, list[tuple[Any, str, Any]]] = {}
    per_entry: dict[str, dict[str, Any]] = {}
    for name in names:
        exc = exception_for(name)
        patch = real[name]
        patches._failed.clear()  # each entry on its own (mxfp4 is applied by the layer too)
        try:
            if patch.install is not None:
                injected = dataclasses.replace(
                    patch, install=failing(name, patch.install, "after", exc, changed))
                for m in patch.modules:
                    if m in modules:
                        patches._install(injected, modules[m], lambda _d: None, strict=True)
            elif name == "attention_layer":
                from vllm_dsv4_backend import layer

                # Fails once the plugin's layer is in place (then it must go).
                vllm_cls = cpu_sparse.DeepseekV4CPUAttention
                register_backend = attention._register_backend_of

                def failing_register(cls: type, exc: type[Exception] = exc,
                                     vllm_cls: type = vllm_cls) -> None:
                    if cpu_model.DeepseekV4CPUAttention is not vllm_cls:
                        changed["attention_layer"] = [
                            (cpu_model, "DeepseekV4CPUAttention", vllm_cls)]
                    raise exc("injected into attention_layer")

                attention._register_backend_of = failing_register
                try:
                    attention.install_attention_layer(
                        lambda: layer.get_attention_layer_cls("cpu"), platform="cpu")
                finally:
                    attention._register_backend_of = register_backend
            elif name == "swa_unread_kernels":
                from vllm_dsv4_backend import backend

                backend._SWA_BUILDER_CLS = None
                backend._cpu_swa_builder_cls = failing(
                    name, backend._cpu_swa_builder_cls, "after", exc, changed)
                backend.get_swa_builder_cls()
            elif name == "sleep_mode_workspace_pool":
                from vllm_dsv4_backend.vllm_compat import sleep_mode

                sleep_mode._vllm_alloc_context = failing(
                    name, sleep_mode._vllm_alloc_context, "after", exc, changed)
                sleep_mode.reservation_context()
            else:
                per_entry[name] = {"raised": None, "untested": True}
                continue
            per_entry[name] = {"raised": None}
        except Exception as e:  # noqa: BLE001 - the report says what
            per_entry[name] = {"raised": type(e).__name__, "message": str(e),
                               "cause": type(e.__cause__).__name__ if e.__cause__ else None,
                               "expected_cause": exc.__name__}
        # Checked now: a later entry may apply this one for real (the layer applies mxfp4).
        per_entry[name]["not_restored"] = _not_restored({name: changed.get(name, [])})
    # 2. What `vllm serve` does: load the plugins, then import arg_utils; the failing
    # hook must stop startup there, from inside that import.
    patches._failed.clear()
    patches._records.clear()
    patches.PATCHES["architecture_check"] = dataclasses.replace(
        real["architecture_check"], install=failing(
            "architecture_check", real["architecture_check"].install, "before",
            AttributeError, {}))
    sys.modules.pop("vllm.engine.arg_utils")
    from vllm.plugins import load_general_plugins

    startup: dict[str, Any] = {}
    try:
        load_general_plugins()
        importlib.import_module("vllm.engine.arg_utils")
        startup["raised"] = None
    except Exception as e:  # noqa: BLE001 - the report says what
        startup = {"raised": type(e).__name__, "message": str(e),
                   "cause": type(e.__cause__).__name__ if e.__cause__ else None}
    report = {"startup": startup, "per_entry": per_entry,
              "changed": {n: len(v) for n, v in changed.items()}}
    Path(out_path).write_text(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "imports":
        _imports_worker(sys.argv[2], sys.argv[3])
    else:
        _strict_worker(sys.argv[3])


# ----------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------
pytest.importorskip("vllm")

from tests.support.vllm_helpers import run_script_report  # noqa: E402
from vllm_dsv4_backend.vllm_compat import patches  # noqa: E402

NAMES = list(patches.PATCHES)
CASES = [(mode, n) for mode in ("after", "before") for n in NAMES
         if n not in NOT_FAILED[mode]]


@pytest.fixture(scope="module")
def imports_reports(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("patch_failures")
    return {mode: run_script_report(__file__, ["imports", mode], out / f"{mode}.json",
                                    timeout=600)
            for mode in ("after", "before")}


@pytest.fixture(scope="module")
def strict_report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("patch_failures_strict")
    return run_script_report(__file__, ["strict", "-"], out / "strict.json", timeout=600)


def test_every_entry_has_an_injection_point():
    missing = [n for n, p in patches.PATCHES.items() if p.install is None and n not in ELSEWHERE]
    assert missing == [], (f"registry entries {missing} have no install function: add where "
                           "their failure is injected to ELSEWHERE")


@pytest.mark.vllm
@pytest.mark.parametrize("mode,name", CASES)
def test_failing_patch_keeps_vllm(imports_reports, mode, name):
    r = imports_reports[mode]
    assert r["names"] == NAMES
    assert r["import_errors"] == {}, "vLLM's modules must import whatever a patch raised"
    named = [e for e in r["errors"] if f"patch {name} " in e]
    assert len(named) == 1, (f"{name}: expected one ERROR line naming it, got {named}; "
                             f"all ERROR lines: {r['errors']}")
    assert exception_for(name).__name__ in named[0]
    assert name not in r["not_restored"], f"vLLM's objects not put back: {r['not_restored']}"
    if mode == "after" and name not in CHANGES_NOTHING:
        assert r["changed"].get(name, 0) > 0, f"{name}'s real install changed nothing"


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["after", "before"])
def test_failing_patches_leave_vllm_as_it_was(imports_reports, mode):
    r = imports_reports[mode]
    assert r["leftover_ports"] == [], "a failed patch left its replacement in vLLM"
    assert r["layer_is_vllms"] and r["swa_builder_is_vllms"]
    # Every ERROR line is a failed patch's (nothing else broke).
    assert all("vllm_dsv4_backend: patch " in e for e in r["errors"]), r["errors"]


@pytest.mark.vllm
def test_explicit_request_turns_a_failing_patch_into_a_startup_error(strict_report):
    s = strict_report["startup"]
    assert s["raised"] == "PatchError", s
    assert "patch architecture_check" in s["message"] and "AttributeError" in s["message"]
    assert "VLLM_DSV4_ATTN_IMPL=plugin" in s["message"] and s["cause"] == "AttributeError"


@pytest.mark.vllm
@pytest.mark.parametrize("name", NAMES)
def test_explicit_request_names_the_failing_patch(strict_report, name):
    r = strict_report["per_entry"][name]
    assert r["raised"] == "PatchError", r
    assert f"patch {name} " in r["message"] and r["cause"] == r["expected_cause"], r
    assert r["not_restored"] == {}, f"vLLM's objects not put back: {r['not_restored']}"
    if name not in CHANGES_NOTHING:
        assert strict_report["changed"].get(name, 0) > 0, f"{name}'s real install changed nothing"


_REGISTER_FAILS = r"""
import json, logging, sys
records = []
class H(logging.Handler):
    def emit(self, r):
        records.append((r.levelname, r.getMessage()))
logging.getLogger("vllm_dsv4_backend").addHandler(H())
from vllm_dsv4_backend import plugin
from vllm_dsv4_backend.vllm_compat import hooks
def boom(platform):
    raise KeyError("injected")
plugin._select_attention_layer = boom
out = {}
try:
    plugin.register()
    out["raised"] = None
except Exception as e:
    out["raised"] = type(e).__name__
out["pending"] = hooks.pending()
out["state"] = plugin.state().get("stood_aside")
import vllm.engine.arg_utils  # what every `vllm serve` imports
out["errors"] = [m for lvl, m in records if lvl == "ERROR"]
print(json.dumps(out))
"""


@pytest.mark.vllm
@pytest.mark.parametrize("impl", ["auto", "plugin"])
def test_register_survives_its_own_failure(impl):
    """An unexpected exception inside register() (not a patch's: the layer
    selection after the registry was armed) is one ERROR line, the armed hooks
    dropped, vLLM imports; only VLLM_DSV4_ATTN_IMPL=plugin raises it."""
    import subprocess

    env = {**os.environ, "VLLM_DSV4_ATTN_IMPL": impl}
    p = subprocess.run([sys.executable, "-c", _REGISTER_FAILS], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if impl == "plugin":
        assert out["raised"] == "KeyError", out
        return
    assert out["raised"] is None and out["pending"] == [], out
    assert "register() failed: KeyError" in out["state"], out
    errors = [e for e in out["errors"] if "register() failed" in e]
    assert len(errors) == 1 and "stands aside" in errors[0], out["errors"]
