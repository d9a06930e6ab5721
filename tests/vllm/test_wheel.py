# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The package as users install it: a wheel and an sdist built from ``pyproject.toml``
(setuptools' PEP 517 hooks, as ``python -m build --no-isolation`` calls them), installed
into a fresh venv beside vLLM's CPU build, serving the tiny model.

Why the fresh venv is honest. ``.venv`` holds this checkout as an *editable* install
(``__editable__.vllm_dsv4_backend-0.1.0.pth`` and its finder, plus a
``vllm_dsv4_backend-0.1.0.dist-info`` whose entry point vLLM would load). The fresh venv
(``python -m venv --without-pip``: no ``--system-site-packages``, which from a venv's
interpreter would mean the base Python's packages anyway) gets a symlink to every entry of
``.venv``'s site-packages (vLLM, torch and their dependencies) *except* those three names,
so the editable install does not exist there; the wheel is then installed into it with pip
(``--no-deps --no-index``). The server runs with ``python -P`` (no current directory on
``sys.path``) from a scratch directory with ``PYTHONPATH`` unset, so the checkout is not
importable; every vLLM process's marker (``package_dir``) must name the venv's
site-packages, and the entry point must come from the wheel's dist-info alone.

About 60 s (one engine start, the build and the venv a few seconds).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.support import ROOT  # noqa: E402
from vllm_dsv4_backend import __version__  # noqa: E402
from vllm_dsv4_backend import run as R  # noqa: E402
from vllm_dsv4_backend.run.config import build_serve_command  # noqa: E402
from vllm_dsv4_backend.run.server import ServerProcess, find_free_port  # noqa: E402

SCRATCH = Path(os.environ.get("DSV4_SCRATCH", ROOT / ".scratch"))
PKG = "vllm_dsv4_backend"
MASKED = (PKG, "__editable__", f"__editable___{PKG}")  # the editable install's entries
ENTRY = "dsv4_backend = vllm_dsv4_backend.plugin:register"


def _package_files() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in (ROOT / PKG).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def _build(tmp: Path) -> tuple[Path, Path]:
    """Wheel and sdist from a copy of what the sdist needs (not the checkout itself:
    nothing written next to the sources)."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / PKG, src / PKG, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp / "dist"
    names = tmp / "built.txt"  # the hooks' return values (setuptools prints to stdout)
    # (build_meta rewrites sys.argv while it runs setup: read the arguments first)
    code = ("import sys; out, names = sys.argv[1:3]; from setuptools import build_meta as b; "
            "w = b.build_wheel(out); s = b.build_sdist(out); "
            "open(names, 'w').write(w + ' ' + s)")
    r = subprocess.run([sys.executable, "-c", code, str(out), str(names)], cwd=src,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel_name, sdist_name = names.read_text().split()
    return out / wheel_name, out / sdist_name


def _fresh_venv(tmp: Path, wheel: Path) -> tuple[Path, Path]:
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    py = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(py), "-c", purelib], capture_output=True, text=True,
                               check=True).stdout.strip())
    base = Path(sysconfig_purelib())
    for entry in base.iterdir():
        if entry.name.startswith(MASKED) or entry.name == "__pycache__":
            continue
        (site / entry.name).symlink_to(entry)
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install",
                        "--no-deps", "--no-index", "--disable-pip-version-check", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return py, site


def sysconfig_purelib() -> str:
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def _clean_env(tmp: Path, markers: Path) -> dict[str, str]:
    env = R.cpu_env(SCRATCH)
    env.pop("PYTHONPATH", None)
    # A short TMPDIR: vLLM's IPC socket paths must stay under 107 characters.
    short = SCRATCH / "tests" / f"wheel-{os.getpid()}"
    short.mkdir(parents=True, exist_ok=True)
    env.update(TMPDIR=str(short), VLLM_DSV4_MARKER_DIR=str(markers),
               VLLM_DSV4_ATTN_IMPL="plugin", PYTHONUNBUFFERED="1")
    return env


@pytest.mark.vllm
@pytest.mark.slow
def test_wheel_builds_installs_and_serves(tmp_path: Path) -> None:
    t0 = time.monotonic()
    wheel, sdist = _build(tmp_path)
    assert wheel.name == f"vllm_dsv4_backend-{__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        dist_info = f"vllm_dsv4_backend-{__version__}.dist-info"
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
        metadata = z.read(f"{dist_info}/METADATA").decode()
    assert "[vllm.general_plugins]" in entry_points and ENTRY in entry_points
    assert "vllm-dsv4-run = vllm_dsv4_backend.run.cli:main" in entry_points
    missing = _package_files() - names
    assert missing == set(), f"not in the wheel: {sorted(missing)[:10]}"
    assert not any(n.startswith(("tests/", "tools/", "configs/")) for n in names)
    assert "Name: vllm-dsv4-backend" in metadata and "vllm serve" in metadata  # README
    with tarfile.open(sdist) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
    assert {"pyproject.toml", "README.md"} <= members
    assert _package_files() - members == set()
    built_s = time.monotonic() - t0

    py, site = _fresh_venv(tmp_path, wheel)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    markers = run_dir / "markers"
    env = _clean_env(run_dir, markers)
    code = ("import json, importlib.metadata as m, vllm_dsv4_backend as p; "
            "eps = [(e.name, e.value, str(e.dist._path)) for e in "
            "m.entry_points(group='vllm.general_plugins')]; "
            "print(json.dumps({'file': p.__file__, 'eps': eps}))")
    probe = subprocess.run(
        [str(py), "-P", "-c", code],
        cwd=run_dir, env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert Path(found["file"]).resolve().is_relative_to(site.resolve()), found
    ours = [e for e in found["eps"] if e[1].startswith(PKG)]  # vLLM ships plugins of its own
    assert [(n, v) for n, v, _ in ours] == [("dsv4_backend", "vllm_dsv4_backend.plugin:register")]
    assert Path(ours[0][2]).parent.resolve() == site.resolve(), found

    serve = R.load_serve_config(R.TINY_SERVE_CONFIG)
    port = find_free_port("127.0.0.1")
    cmd = build_serve_command(serve, host="127.0.0.1", port=port, python=str(py))
    cmd.insert(1, "-P")  # no current directory on sys.path
    server = ServerProcess(cmd, host="127.0.0.1", port=port, log_path=run_dir / "server.log",
                           env=env, cwd=run_dir)
    try:
        server.start()
        server.wait_healthy(timeout=float(os.environ.get("DSV4_SERVER_TIMEOUT", "900")))
        body = json.dumps({"model": serve.served_model_name, "prompt": "Hello",
                           "max_tokens": 4, "temperature": 0.0}).encode()
        import urllib.request

        req = urllib.request.Request(server.base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
        assert out["choices"][0]["text"] is not None
    finally:
        server.stop(timeout=60)
    states = [json.loads(p.read_text()) for p in sorted(markers.glob("*.json"))]
    roles = {s["role"] for s in states}
    assert {"frontend", "engine_core", "worker"} <= roles, roles
    for s in states:
        assert Path(s["package_dir"]).resolve().is_relative_to(site.resolve()), s
        assert s["attention_layer"].startswith("plugin "), s
    log = server.log_path.read_text(errors="replace")
    assert "workspace (CPU): policy shared" in log  # the installed layer reserved it
    print(f"wheel + sdist built in {built_s:.1f} s; served from {site}")
