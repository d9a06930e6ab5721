# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The layer core both platforms share (``vllm_dsv4_backend.layer.core``),
without vLLM: the workspace config from a vLLM-shaped config, the per-model
registry, reserve-and-report, the step holder, and the one ``layer_kind``.

And the floor between the two: the workspace (``vllm_dsv4_backend.workspace``)
is the model-agnostic mechanism, DeepSeek-V4's families, lease plans and
sizing report live on the layer floor (``layer.plan``, ``layer.sizing``),
and one builder (``plan.build_workspace_config``) makes every config."""

from __future__ import annotations

import ast
import dataclasses
import io
import logging
import re
import subprocess
import sys
import tokenize
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.families import EVERY_FAMILY_PLAN, FAMILIES
from vllm_dsv4_backend.formats import constants
from vllm_dsv4_backend.layer import core, plan
from vllm_dsv4_backend.layer import sizing as layer_sizing
from vllm_dsv4_backend.workspace import sizing

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_dsv4_backend"
WORKSPACE = PACKAGE / "workspace"


def _vllm_config(dtype: str = "fp8", ubatching: bool = False, hf=None) -> SimpleNamespace:
    hf = hf or SimpleNamespace(index_n_heads=4, index_head_dim=64, index_topk=8)
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf),
        attention_config=SimpleNamespace(resolve_indexer_kv_dtype=lambda default: dtype),
        parallel_config=SimpleNamespace(use_ubatching=ubatching, num_ubatches=3),
        device_config=SimpleNamespace(device="cpu"),
    )


def _layer() -> SimpleNamespace:
    return SimpleNamespace(max_num_batched_tokens=16, n_local_heads=4, padded_heads=8,
                           head_dim=32)


def test_one_layer_kind():
    assert plan.layer_kind is constants.layer_kind is core.layer_kind
    assert not hasattr(sizing, "layer_kind")  # the workspace knows kinds, not ratios
    assert [constants.layer_kind(r) for r in (0, 1, 4, 128)] == ["swa", "swa", "c4", "c128"]
    for bad in (16, 2, -4, True, "4", 4.0, None):
        with pytest.raises(ValueError, match=r"\[0, 1, 4, 128\]"):
            constants.layer_kind(bad)
    # The builder's kinds are the compress ratios, labelled by constants.LAYER_KINDS.
    cfg = plan.build_workspace_config(plan.Dims(4, 8), max_num_batched_tokens=8,
                                      indexer_kv_dtype="fp8")
    assert set(cfg.kinds) == set(constants.LAYER_KINDS)
    assert dict(cfg.kind_labels) == {r: k.upper() for r, k in constants.LAYER_KINDS.items()}
    with pytest.raises(ValueError, match=r"compress_ratio: expected one of \[0, 1, 4, 128\]"):
        plan.build_workspace_config(plan.Dims(4, 8), max_num_batched_tokens=8,
                                    indexer_kv_dtype="fp8", compress_ratios=(0, 16))
    with pytest.raises(ValueError, match="layer kind"):
        cfg.layer_families(16)


@pytest.mark.parametrize(("asked", "want"), [("fp8", "fp8"), ("mxfp4", "mxfp4"),
                                             ("bf16", "fp8")])
def test_workspace_config_from_vllm_config(asked, want):
    cfg = core.workspace_config(_vllm_config(asked, ubatching=True), _layer(), "cuda")
    p = cfg.params
    assert (cfg.max_num_batched_tokens, p["num_local_heads"], p["padded_q_heads"],
            p["head_dim"]) == (16, 4, 8, 32)
    assert (p["index_n_heads"], p["index_head_dim"], p["index_topk"]) == (4, 64, 8)
    assert p["indexer_kv_dtype"] == want
    assert p["plan"] == "cuda"
    assert cfg.num_ubatches == 3
    assert cfg.layer_kinds == ()  # the layers register themselves (add_layer)
    assert [s.name for s in cfg.family_buffers("q")] == ["out"]
    # The one builder, with the platform's own lease plan.
    dims = plan.Dims(num_local_heads=4, padded_q_heads=8, head_dim=32, index_n_heads=4,
                     index_head_dim=64, index_topk=8)
    assert cfg == plan.build_workspace_config(dims, max_num_batched_tokens=16,
                                              indexer_kv_dtype=want, platform="cuda",
                                              num_ubatches=3)
    # The same plan given explicitly: the same config but for its source.
    custom = plan.build_workspace_config(dims, max_num_batched_tokens=16,
                                         indexer_kv_dtype=want,
                                         plan=plan.LEASE_PLAN["cuda"][want], num_ubatches=3)
    assert custom.params["plan"] == "custom"
    assert dataclasses.replace(custom, params=cfg.params) == cfg


def _reserved(cfg: sizing.WorkspaceConfig) -> dict[str, dict[str, list[str]]]:
    return {kind: {f: [s.name for s in cfg.family_buffers(f)] for f in cfg.layer_families(r)}
            for kind, r in (("swa", 0), ("c4", 4), ("c128", 128))}


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", ["fp8", "mxfp4"])
def test_lease_plan_is_what_sizing_reserves(platform, dtype):
    """The workspace reserves exactly the plan's (family, view) pairs: no
    ``topk.local`` (both layers write vLLM's topk_indices_buffer), no padded
    q (vLLM's fused q-norm/RoPE kernel returns its own), compressor scratch
    only for CUDA's C128 layers, MXFP4 scales only under MXFP4."""
    vc = _vllm_config(dtype)
    cfg = core.workspace_config(vc, _layer(), platform)
    indexer_q = ["q", "weights"] if dtype == "fp8" else ["q", "scales", "weights"]
    topk = ["global"] if (platform, dtype) == ("cpu", "fp8") else ["global", "lens"]
    want = {"swa": {"q": ["out"]},
            "c4": {"q": ["out"], "indexer_q": indexer_q, "topk": topk},
            "c128": {"q": ["out"]}}
    if platform == "cuda":
        want["c128"]["compressor"] = ["scratch"]
    assert _reserved(cfg) == want
    # ... which is plan.LEASE_PLAN less the views the dtype does not have.
    lp = plan.LEASE_PLAN[platform][dtype]
    assert _reserved(cfg) == {
        kind: {f: [v for v in views if v in indexer_q or f != "indexer_q"]
               for f, views in lp[kind].items()} for kind in ("swa", "c4", "c128")}
    # Only the families some kind leases exist at all.
    assert cfg.family_names == tuple(f for f in FAMILIES
                                     if any(f in fams for fams in lp.values()))
    # An explicit plan with every view (the sizing before lease plans) reserves
    # topk.local and every family for C4.
    every = plan.build_workspace_config(plan.Dims(4, 8), max_num_batched_tokens=16,
                                        indexer_kv_dtype=dtype, plan=EVERY_FAMILY_PLAN)
    assert every.params["plan"] == "custom"
    assert [s.name for s in every.family_buffers("topk")] == ["local", "global", "lens"]
    assert every.layer_families(4) == FAMILIES


def test_lease_plan_refuses_unknown_names():
    def build(**kw):
        return plan.build_workspace_config(plan.Dims(4, 8), max_num_batched_tokens=8,
                                           indexer_kv_dtype="fp8", **kw)

    with pytest.raises(ValueError, match="platform"):
        build(platform="tpu")
    with pytest.raises(ValueError, match="unknown layer kind 'c8'"):
        build(plan={"c8": {"q": ("out",)}})
    with pytest.raises(ValueError, match="unknown family 'kv'"):
        build(plan={"c4": {"kv": ("q",)}})
    with pytest.raises(ValueError, match="views"):
        build(plan={"c4": {"topk": ("idx",)}})
    with pytest.raises(ValueError, match="views"):
        build(plan={"c4": {"topk": ()}})
    with pytest.raises(ValueError, match="one kind and"):
        build(plan={"c4": {"q": ("out",)}, "swa": {"q": ("q", "out")}})
    with pytest.raises(ValueError, match="indexer_kv_dtype"):
        plan.build_workspace_config(plan.Dims(4, 8), max_num_batched_tokens=8,
                                    indexer_kv_dtype="nvfp4")
    # Every declared plan passes its own builder.
    for platform, per_dtype in plan.LEASE_PLAN.items():
        for dtype, lp in per_dtype.items():
            plan.build_workspace_config(plan.Dims(4, 8), max_num_batched_tokens=8,
                                        indexer_kv_dtype=dtype, plan=lp)


def test_sizing_table_sizes_the_plans(capsys):
    """At 8192 tokens (TP 1) the plan drops what no layer leases: under
    ``shared`` CUDA keeps C128's compressor scratch, CPU reserves none, and
    neither reserves ``topk.local``; the #49236 pool is 548 MiB."""
    mib = sizing.MIB
    rows = {p: layer_sizing.memory_table(platform=p, tp_sizes=(1,), policies=("shared",))
            for p in ("cpu", "cuda")}
    # The sizing before lease plans, now an explicit plan through the same builder.
    dims, ratios = plan.dims_from_hf_config(plan.DSV4_FLASH_HF_CONFIG, tp_size=1)
    old = [sizing.workspace_bytes(plan.build_workspace_config(
        dims, max_num_batched_tokens=8192, indexer_kv_dtype=d, plan=EVERY_FAMILY_PLAN,
        compress_ratios=ratios), "shared").per_family for d in constants.INDEXER_KV_DTYPES]
    for p, rs in rows.items():
        for r, o in zip(rs, old, strict=True):
            assert round(r["pool49236"] / mib) == 548
            lens = 8192 * 4 if (p, r["indexer"]) == ("cpu", "fp8") else 0
            assert r["families"]["topk"] == o["topk"] - 8192 * 512 * 4 - lens
            assert r["families"].get("compressor", 0) == (8192 * 512 * 4 if p == "cuda" else 0)
            assert ("compressor" in r["families"]) == (p == "cuda")
            assert r["families"]["q"] == o["q"]  # the output instead of the padded q
    layer_sizing.main(["--tp", "1"])
    out = capsys.readouterr().out
    assert "cpu: the layer's lease plan" in out and "cuda: the layer's lease plan" in out


# --- the floor: the workspace names no model, the layer floor builds its config ----------


def _prose_and_code(path: Path) -> tuple[str, str]:
    """``path``'s documentation (docstrings, bare string statements, comments)
    and the rest of its source, each as text."""
    src = path.read_text()
    lines = src.splitlines(keepends=True)
    doc_lines: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and \
                isinstance(node.value.value, str):
            doc_lines.update(range(node.lineno, node.end_lineno + 1))
    comments: dict[int, int] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.start[1]
    prose, code = [], []
    for i, line in enumerate(lines, start=1):
        if i in doc_lines:
            prose.append(line)
        elif i in comments:
            prose.append(line[comments[i]:])
            code.append(line[:comments[i]] + "\n")
        else:
            code.append(line)
    return "".join(prose), "".join(code)


# DeepSeek-V4's own family and view names, and the model's name.
DSV4_NAMES = ("indexer_q", "topk", "compressor", "scratch", "scales", "deepseek")
# Where the workspace's prose may still say them (lower-case name -> at most
# this many times): the history of #49236 and pointers to the layer floor.
PROSE_ALLOWED = {
    "__init__.py": {"deepseek": 1},      # "DeepSeek-V4's: vllm_dsv4_backend.layer.plan"
    "alloc_counter.py": {"scratch": 1},  # "a C++ op's scratch" (any op's, not a family)
    "budget.py": {"deepseek": 1},        # the example: 24 GiB for DeepSeek-V4-Flash
    "manager.py": {"deepseek": 2,        # #49236's history; vLLM's DeepseekV4Attention
                   "scratch": 1},        # "one model-wide scratch pool" (#49236)
    "sizing.py": {"deepseek": 1},        # "DeepSeek-V4's families ... live on the layer floor"
}


def _workspace_sources() -> list[Path]:
    paths = sorted(WORKSPACE.rglob("*.py"))
    assert {p.name for p in paths} >= {"__init__.py", "manager.py", "sizing.py", "lease.py"}
    return paths


def test_workspace_names_no_deepseek_family():
    """No DeepSeek-V4 family or view name, nor the model's name, in the
    workspace's code (identifiers, strings); in its prose only the pinned
    history notes and pointers (PROSE_ALLOWED)."""
    every = {f: [v.name for v in views] for f, views in
             plan.family_views(plan.Dims(4, 8), "mxfp4").items()}
    assert set(DSV4_NAMES[:5]) <= set(every) | {v for vs in every.values() for v in vs}
    # Every name of the plan: a string literal in the workspace's code would
    # be a family or view the mechanism knows by name.
    literals = set(every) | {v for vs in every.values() for v in vs}
    found: list[str] = []
    for path in _workspace_sources():
        rel = path.relative_to(WORKSPACE).as_posix()
        prose, code = _prose_and_code(path)
        for name in DSV4_NAMES:
            if name in code.lower():
                found.append(f"{rel}: {name!r} in code")
            n = prose.lower().count(name)
            if n > PROSE_ALLOWED.get(rel, {}).get(name, 0):
                found.append(f"{rel}: {name!r} {n} times in prose")
        tree = ast.parse(path.read_text())
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and id(node) not in docs and \
                    isinstance(node.value, str) and node.value in literals:
                found.append(f"{rel}:{node.lineno}: string {node.value!r}")
    assert found == []


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports
    resolved inside ``vllm_dsv4_backend.workspace``; ``from X import y``
    counts ``X`` and ``X.y``)."""
    pkg = ["vllm_dsv4_backend", *path.parent.relative_to(PACKAGE).parts]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = pkg[:len(pkg) - node.level + 1] if node.level else []
            mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__"):
                out.add(node.args[0].value)
    return out


# The layer floor, and DeepSeek-V4's formats (``formats.constants.layer_kind``,
# the compress ratios the workspace used to validate).
FORBIDDEN_IMPORTS = ("vllm_dsv4_backend.layer", "vllm_dsv4_backend.formats")


def test_workspace_imports_nothing_from_the_layer_floor():
    found = {}
    for path in _workspace_sources():
        bad = sorted(m for m in _imported_modules(path)
                     if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_IMPORTS))
        if bad:
            found[path.relative_to(WORKSPACE).as_posix()] = bad
    assert found == {}
    # The resolver itself sees relative and absolute imports.
    assert "vllm_dsv4_backend.workspace.sizing" in _imported_modules(WORKSPACE / "manager.py")
    assert "vllm_dsv4_backend.workspace.live" in _imported_modules(WORKSPACE / "manager.py")
    # And at run time: importing every workspace module loads neither.
    code = ("import importlib, pkgutil, sys\n"
            "import vllm_dsv4_backend.workspace as w\n"
            "for m in pkgutil.iter_modules(w.__path__):\n"
            "    importlib.import_module('vllm_dsv4_backend.workspace.' + m.name)\n"
            f"print(sorted(k for k in sys.modules if k.startswith({FORBIDDEN_IMPORTS!r})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PACKAGE.parent, check=True).stdout
    assert out.strip() == "[]"


def _cli_tables(out: str) -> dict[str, list[dict[str, str]]]:
    """The CLI's markdown tables, per platform: one {column: cell} per row."""
    tables: dict[str, list[dict[str, str]]] = {}
    platform, head = None, None
    for line in out.splitlines():
        m = re.match(r"^(\w+): the layer's lease plan", line)
        if m:
            platform, head = m.group(1), None
            tables[platform] = []
        elif platform and line.startswith("| TP"):
            head = [c.strip() for c in line.strip("|").split("|")]
        elif platform and head and line.startswith("| ") and not line.startswith("|---"):
            tables[platform].append(
                dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=True)))
    return tables


def test_sizing_cli_and_serving_config_agree_on_bytes(capsys):
    """One builder: the table ``python -m vllm_dsv4_backend.layer.sizing``
    prints and the config serving builds (``core.workspace_config`` from a
    vLLM config and layer) give the same bytes per family, total and #49236
    pool, for every TP, indexer dtype, policy and platform."""
    hf_dict = plan.DSV4_FLASH_HF_CONFIG
    hf = SimpleNamespace(**hf_dict)
    layer_sizing.main([])
    tables = _cli_tables(capsys.readouterr().out)
    assert sorted(tables) == ["cpu", "cuda"]
    checked = 0
    for platform, cli_rows in tables.items():
        rows = layer_sizing.memory_table(platform=platform)
        assert len(cli_rows) == len(rows) == 3 * 2 * 3
        for tp in (1, 4, 8):
            local = hf_dict["num_attention_heads"] // tp
            layer = SimpleNamespace(max_num_batched_tokens=8192, n_local_heads=local,
                                    padded_heads=plan.padded_q_heads(local),
                                    head_dim=hf_dict["head_dim"])
            ratios = tuple(hf_dict["compress_ratios"][:hf_dict["num_hidden_layers"]])
            for dtype in constants.INDEXER_KV_DTYPES:
                cfg = core.workspace_config(_vllm_config(dtype, hf=hf), layer, platform)
                # Serving's config is the table's, but for the layers it registers.
                dims, table_ratios = plan.dims_from_hf_config(hf, tp_size=tp)
                assert table_ratios == ratios
                assert dataclasses.replace(cfg, layer_kinds=ratios) == \
                    plan.build_workspace_config(dims, max_num_batched_tokens=8192,
                                                indexer_kv_dtype=dtype, platform=platform,
                                                compress_ratios=ratios)
                pool = layer_sizing.pool49236_bytes(cfg)["total"]
                for policy in sizing.POLICIES:
                    wb = sizing.workspace_bytes(cfg, policy, layer_kinds=ratios)
                    row = next(r for r in rows
                               if (r["tp"], r["indexer"], r["policy"]) == (tp, dtype, policy))
                    assert row["families"] == wb.per_family
                    assert (row["total"], row["pool49236"]) == (wb.total, pool)
                    cli = next(r for r in cli_rows
                               if (r["TP"], r["indexer"], r["policy"]) ==
                               (str(tp), dtype, policy))
                    assert cli["heads (local/padded)"] == f"{local}/{layer.padded_heads}"
                    assert float(cli["#49236 pool"].replace(",", "")) == \
                        pytest.approx(pool / sizing.MIB, abs=0.005)
                    if policy == "off":
                        assert cli["**total**"] == "0 (allocator)"
                        continue
                    assert [c for c in cli if c in FAMILIES] == list(cfg.family_names)
                    for f in cfg.family_names:
                        assert float(cli[f].replace(",", "")) == \
                            pytest.approx(wb.per_family[f] / sizing.MIB, abs=0.005), (f, cli)
                    assert float(cli["**total**"].strip("*").replace(",", "")) == \
                        pytest.approx(wb.total / sizing.MIB, abs=0.005)
                    checked += 1
    assert checked == 2 * 3 * 2 * 2


def test_num_ubatches():
    assert core.num_ubatches(SimpleNamespace(use_ubatching=False, num_ubatches=4)) == 1
    assert core.num_ubatches(SimpleNamespace(use_ubatching=True, num_ubatches=4)) == 4
    assert core.num_ubatches(SimpleNamespace(use_ubatching=True)) == 2


def test_registry_one_manager_per_model_and_key(monkeypatch):
    monkeypatch.setattr(core, "_managers", {})
    vc = _vllm_config()
    a = core.manager_for(vc, _layer(), "cpu")
    assert core.manager_for(vc, _layer(), "cpu") is a
    key = object()
    b = core.manager_for(vc, _layer(), "cpu", key)
    assert b is not a and core.manager_for(vc, _layer(), "cpu", key) is b
    assert core.manager_for(_vllm_config(), _layer(), "cpu") is not a


def test_reserve_and_report_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(core, "_managers", {})
    ws = core.manager_for(_vllm_config("mxfp4"), _layer(), "cpu")
    ws.add_layer("layers.0", 4)
    ws.add_layer("layers.1", 128)
    caplog.set_level(logging.INFO, logger="vllm_dsv4_backend")
    assert core.reserve_and_report(ws, "CPU") is True
    assert core.reserve_and_report(ws, "CPU") is False
    lines = [r.getMessage() for r in caplog.records if "workspace (CPU)" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "policy shared" in lines[0] and "1 micro-batch(es)" in lines[0]
    assert "indexer_q" in lines[0] and "for 2 layers" in lines[0]


def test_step_holder_per_micro_batch(monkeypatch):
    monkeypatch.setattr(core, "_managers", {})
    ws = core.manager_for(_vllm_config(ubatching=True), _layer(), "cpu")
    ws.add_layer("layers.0", 0)
    ws.reserve()
    ids = [0]
    monkeypatch.setattr(core, "ubatch_id", lambda: ids[0])
    holder = core.RegionHolder(ws, "layers.0")
    assert not holder.current()
    with holder.open(4) as s0:
        assert holder.current() is s0 and holder.home() == "cpu"
        ids[0] = 2
        assert not holder.current()
        with holder.open(2) as s2:
            assert holder.current() is s2 and s2.ubatch == 2
            s2.lease("q")
        ids[0] = 0
        assert holder.current() is s0
    assert not holder.current()
    assert ws.stats()["leased_bytes_now"] == 0


@pytest.mark.parametrize("every", [0, 2])
def test_model_steps_and_live_summary(monkeypatch, caplog, every):
    """One model step per forward of the first registered layer for
    micro-batch 0 (``model_step``); the
    summary every ``VLLM_DSV4_WORKSPACE_LOG_EVERY`` steps (0: never)."""
    monkeypatch.setattr(core, "_managers", {})
    monkeypatch.setenv("VLLM_DSV4_WORKSPACE_LOG_EVERY", str(every))
    finalizers = []
    monkeypatch.setattr(core.multiprocessing.util, "Finalize",
                        lambda obj, fn, **k: finalizers.append(fn))
    ws = core.manager_for(_vllm_config(ubatching=True), _layer(), "cpu")
    ws.add_layer("layers.0", 4)
    ws.add_layer("layers.1", 0)
    ws.reserve()
    ids = [0]
    monkeypatch.setattr(core, "ubatch_id", lambda: ids[0])
    holders = [core.RegionHolder(ws, n, platform="CPU") for n in ("layers.0", "layers.1")]
    caplog.set_level(logging.INFO, logger="vllm_dsv4_backend")
    for _ in range(5):
        for u in (0, 1):
            ids[0] = u
            for h in holders:
                with h.open(4) as region:
                    region.lease("q")
    live = ws.live_stats()
    assert live["steps"] == 5 and "steps" not in ws.stats()
    assert live["leases_total"] == 5 * 2 * 2 and live["leases_per_step"] == 4.0
    assert live["leases_max_per_step"] == 4
    assert live["allocations_total"] == 0
    assert live["reserved_bytes_total"] == ws.stats()["reserved_bytes_total"] > 0
    lines = [r.getMessage() for r in caplog.records if "workspace live (CPU)" in r.getMessage()]
    if every == 0:
        assert lines == [] and finalizers == []
        return
    assert len(lines) == 2 and "4 model steps" in lines[1], lines
    assert "leases 4.0/step" in lines[1] and "allocations in leased families 0.0/step" in lines[1]
    assert len(finalizers) == 1
    finalizers[0]()
    assert "5 model steps" in caplog.records[-1].getMessage()
    assert "at shutdown" in caplog.records[-1].getMessage()


def test_one_seam_for_both_layers(monkeypatch):
    """Both layers are ``(vLLM's class, core.WorkspaceLayer)``: one set of names for
    the workspace, the region holder, the owner link and the reservation; a model
    step begins in the region holder only (the first registered layer's forward
    for micro-batch 0), where the layer's own step-start work (``on_step``) runs."""
    monkeypatch.setattr(core, "_managers", {})
    ws = core.manager_for(_vllm_config("mxfp4", ubatching=True), _layer(), "cpu")
    ids = [0]
    monkeypatch.setattr(core, "ubatch_id", lambda: ids[0])

    class Sub:
        pass

    class SubPlugin(Sub):
        pass

    class Layer(core.WorkspaceLayer):
        def __init__(self, prefix: str) -> None:
            self.prefix, self.compress_ratio, self.indexer = prefix, 4, Sub()

    began: list[str] = []
    layers = [Layer(f"layers.{i}") for i in range(2)]
    for layer in layers:
        layer._dsv4_attach_workspace(ws, "CPU", on_step=lambda n=layer.prefix: began.append(n))
        layer._dsv4_adopt(layer.indexer, SubPlugin)
    assert list(ws.layers) == ["layers.0", "layers.1"]
    first, second = layers
    assert type(first.indexer) is SubPlugin and core.owner_of(first.indexer) is first
    assert first.indexer_kv_dtype == second.indexer_kv_dtype == "mxfp4"
    first._dsv4_reserve()
    assert ws.reserved
    assert not first._dsv4_current_region() and first._dsv4_home_stream() is None
    for _ in range(3):
        for u in (0, 1):
            ids[0] = u
            for layer in layers:
                with layer.dsv4_region(4) as region:
                    assert layer._dsv4_current_region() is region
                    assert layer._dsv4_home_stream() == "cpu"
    assert began == ["layers.0"] * 3 and ws.live_stats()["steps"] == 3
    assert first._dsv4_regions.starts_steps and not second._dsv4_regions.starts_steps


def test_indexer_dtype_read_once(monkeypatch):
    """``core.indexer_kv_dtype`` is the one reader (as vLLM resolves it, so the CPU
    backend's check names an unsupported value); the workspace sizes an unknown
    one for FP8 (vLLM's indexer refuses it with its own message)."""
    assert core.indexer_kv_dtype(_vllm_config("bf16")) == "bf16"
    config = core.workspace_config(_vllm_config("bf16"), _layer(), "cpu")
    assert config.params["indexer_kv_dtype"] == "fp8"
    reads = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")
             if "resolve_indexer_kv_dtype" in p.read_text()]
    # vllm_compat/patches.py: vLLM's own dsa_indexer_uses_fp4, lifted on CPU (a floor
    # below the layers, so it cannot import layer.core).
    assert sorted(map(str, reads)) == ["layer/core.py", "vllm_compat/patches.py"], reads
