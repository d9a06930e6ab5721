# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build and verify the FlashMLA carry bundle (stdlib only, no torch, no vLLM import).

The lent GPU box has torch + CUDA but no vLLM and no network, so vLLM's FlashMLA travels
as files::

    <dest>/                                  default .scratch/gpu_bundle/flashmla
      manifest.json                          sources, sizes, sha256, the rewiring, ELF facts
      dsv4_flashmla/__init__.py              written here: paths only, loads nothing
      dsv4_flashmla/_flashmla_C.abi3.so      vLLM's compiled FlashMLA (sm_90a + sm_100f)
      dsv4_flashmla/flash_mla_interface.py   vLLM's third_party/flashmla interface, rewired

The one rewiring (recorded in the manifest): vLLM's interface loads the extension with
``import vllm._flashmla_C`` (the module's import runs the ``.so``'s static initializers,
which register ``torch.ops._flashmla_C``). In the bundle that line becomes
``from . import _flashmla_C``: the same extension-module import (``PyInit__flashmla_C``
matches the file name), from the bundle's package instead of vLLM's, so importing the
interface loads the ``.so`` exactly as vLLM does and fails at exactly that line when it
cannot load. Nothing else changes; the build refuses an interface that imports anything
else from vLLM (a newer vLLM would need a new look).

Usage (here, where a vLLM 0.34 venv or wheel is unpacked)::

    python tools/gpu_flashmla/bundle.py [--vllm-dir DIR] [--dest DIR]
    python tools/gpu_flashmla/bundle.py --verify [--dest DIR]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import mmap
import os
import re
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEST = ROOT / ".scratch" / "gpu_bundle" / "flashmla"
PACKAGE = "dsv4_flashmla"
SO_NAME = "_flashmla_C.abi3.so"
INTERFACE_NAME = "flash_mla_interface.py"
INTERFACE_SRC = Path("third_party") / "flashmla" / INTERFACE_NAME
# The bundle travels in a `run` call with the rest of the tree (64 MiB in all); the
# FlashMLA part must stay a small share of that.
MAX_BUNDLE_BYTES = 16 << 20
# Public API the check calls; the build refuses an interface without them.
INTERFACE_API = ("FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache",
                 "flash_mla_sparse_fwd")
LOAD_LINE = "import vllm._flashmla_C"
LOAD_LINE_NEW = (
    "from . import _flashmla_C  # noqa: F401  # dsv4 bundle: was `import vllm._flashmla_C`"
)
# Preferred source: the vLLM whose FlashMLA the plugin's CUDA layer calls on 0.34.
VENV_CANDIDATES = (".venv-vllm034", ".venv-vllm033")

__all__ = [
    "DEFAULT_DEST",
    "PACKAGE",
    "BundleError",
    "elf_facts",
    "find_vllm_dir",
    "make_bundle",
    "rewire_interface",
    "unresolved",
    "verify_bundle",
]


class BundleError(RuntimeError):
    """The source tree or a bundle is not what the check needs (the message says what)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _vllm_version(vllm_dir: Path) -> str | None:
    # The dist-info next to the package (no import: importing vLLM is what the box lacks).
    for meta in sorted(vllm_dir.parent.glob("vllm-*.dist-info/METADATA")):
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None


def find_vllm_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The ``vllm`` package directory to copy from: ``explicit``, else the first of
    ``.venv-vllm034`` / ``.venv-vllm033`` holding the ``.so``, else this interpreter's
    ``vllm`` (located with ``find_spec``, which does not import it)."""
    if explicit is not None:
        cands = [Path(explicit)]
    else:
        cands = []
        for venv in VENV_CANDIDATES:
            cands += sorted((ROOT / venv / "lib").glob("python3*/site-packages/vllm"))
        import importlib.util

        spec = importlib.util.find_spec("vllm")
        if spec is not None and spec.submodule_search_locations:
            cands += [Path(p) for p in spec.submodule_search_locations]
    for c in cands:
        if (c / SO_NAME).is_file() and (c / INTERFACE_SRC).is_file():
            return c
    raise BundleError(
        f"no vLLM with {SO_NAME} and {INTERFACE_SRC} in {[str(c) for c in cands]} "
        "(build .venv-vllm034: bash scripts/setup_vllm_cuda.sh 0.34, or pass --vllm-dir)"
    )


# ------------------------------------------------------------------------------------------
# ELF facts: what the .so needs from the box (read here, compared there before loading)
# ------------------------------------------------------------------------------------------
def _dynamic(path: Path) -> tuple[set[str], list[str], list[str]]:
    """``(defined, undefined, needed)`` of an ELF64 little-endian shared object: its
    defined dynamic symbols, its undefined non-weak ones (weak ones need not resolve) and
    its ``DT_NEEDED`` libraries. A minimal reader (no binutils on the box), over mmap so a
    450 MB libtorch is not read into memory."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise BundleError(f"{path}: not an ELF64 little-endian file")
        (shoff,) = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        sections = []
        for i in range(shnum):
            (_name, typ, _flags, _addr, off, size, link, _info, _align,
             entsize) = struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
            sections.append((typ, off, size, link, entsize))
        defined: set[str] = set()
        undefined: list[str] = []
        needed: list[str] = []
        for typ, off, size, link, entsize in sections:
            strtab = sections[link][1]

            def cstr(o: int, base: int = strtab) -> str:
                end = data.find(b"\0", base + o)
                return data[base + o:end].decode("ascii", "replace")

            if typ == 11:  # SHT_DYNSYM
                for k in range(1, size // entsize):
                    st_name, st_info, _other, st_shndx = struct.unpack_from(
                        "<IBBH", data, off + k * entsize)
                    if not st_name:
                        continue
                    if st_shndx != 0:
                        defined.add(cstr(st_name))
                    elif st_info >> 4 != 2:  # not STB_WEAK
                        undefined.append(cstr(st_name))
            elif typ == 6:  # SHT_DYNAMIC
                for k in range(size // 16):
                    tag, val = struct.unpack_from("<qQ", data, off + k * 16)
                    if tag == 1:  # DT_NEEDED
                        needed.append(cstr(val))
    return defined, undefined, needed


def elf_facts(path: Path) -> dict[str, Any]:
    """What the ``.so`` needs from the box: ``DT_NEEDED`` libraries; the undefined symbols
    of torch's stable C ABI (``aoti_torch_*`` / ``torch_*``: a torch older than the one
    the wheel pins may lack some, and the load then fails with ``undefined symbol``) and
    the C++ ones (``_Z*``: libstdc++, some newer than an old system's, which torch's own
    libraries may export); the op schemas it registers and the GPU archs it names."""
    _defined, undefined, needed = _dynamic(path)
    data = path.read_bytes()
    schemas = sorted({m.decode() for m in re.findall(
        rb"(?<![A-Za-z_])((?:sparse|dense)_(?:decode|prefill)_(?:fwd|bwd)\(Tensor[^\x00]*)",
        data)})
    archs = sorted({m.decode() for m in re.findall(rb"sm_\d+[af]?(?![0-9a-z_])", data)})
    return {"needed": needed,
            "torch_stable_abi_symbols": sorted(
                s for s in undefined if s.startswith(("aoti_torch_", "torch_"))),
            "cxx_symbols": sorted(s for s in undefined if s.startswith("_Z")),
            "op_schemas": schemas, "arch_strings": archs}


def unresolved(manifest_elf: dict[str, Any], libs: list[Path]) -> dict[str, list[str]]:
    """The ``.so``'s torch stable-ABI and C++ symbols that none of ``libs`` defines (e.g.
    another torch's ``libtorch*.so`` and a ``libstdc++.so.6``): a symbol-level answer to
    "does it load on that torch", checkable here without a GPU."""
    have: set[str] = set()
    for lib in libs:
        have |= _dynamic(lib)[0]
    return {k: [s for s in manifest_elf.get(k, []) if s not in have]
            for k in ("torch_stable_abi_symbols", "cxx_symbols")}


# ------------------------------------------------------------------------------------------
# build
# ------------------------------------------------------------------------------------------
def _imports_of(source: str) -> list[str]:
    mods = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods.append("." * node.level + (node.module or ""))
    return mods


def rewire_interface(source: str) -> tuple[str, list[dict[str, Any]]]:
    """The bundle's interface: ``source`` with its one ``import vllm._flashmla_C`` line
    replaced (see the module docstring). Returns the new text and the change record.

    Raises:
        BundleError: the line is not there exactly once, another vLLM import remains, or
            the API the check calls is missing.
    """
    lines = source.splitlines(keepends=True)
    hits = [i for i, ln in enumerate(lines) if ln.strip() == LOAD_LINE]
    if len(hits) != 1:
        raise BundleError(
            f"{INTERFACE_NAME}: expected exactly one line `{LOAD_LINE}`, found {len(hits)} "
            "(the vendored interface changed: look at how it loads the extension now)")
    i = hits[0]
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = indent + LOAD_LINE_NEW + "\n"
    out = "".join(lines)
    left = [m for m in _imports_of(out) if m == "vllm" or m.startswith("vllm.")]
    if left:
        raise BundleError(f"{INTERFACE_NAME}: still imports {left} after the rewiring")
    defined = {n.name for n in ast.parse(out).body
               if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    missing = [a for a in INTERFACE_API if a not in defined]
    if missing:
        raise BundleError(f"{INTERFACE_NAME}: missing {missing}")
    change = {
        "line": i + 1, "from": LOAD_LINE, "to": LOAD_LINE_NEW,
        "why": "the box has no vllm package; the same extension-module import from the "
               "bundle's package registers torch.ops._flashmla_C just as vLLM's does "
               "(PyInit__flashmla_C matches the file name), and fails at this line when "
               "the .so cannot load",
    }
    return out, [change]


_INIT = '''\
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's FlashMLA (``_flashmla_C.abi3.so`` + ``flash_mla_interface``), carried to a box
without vLLM. Generated by tools/gpu_flashmla/bundle.py from vLLM {version}.
Importing this package loads nothing; ``import dsv4_flashmla.flash_mla_interface`` loads
the extension (as ``import vllm._flashmla_C`` does in vLLM)."""

from pathlib import Path

VLLM_VERSION = {version!r}
SO_PATH = Path(__file__).with_name({so!r})
'''


def make_bundle(vllm_dir: str | os.PathLike[str] | None = None,
                dest: str | os.PathLike[str] = DEFAULT_DEST) -> dict[str, Any]:
    """Write the bundle to ``dest`` (replacing an older one) and return its manifest."""
    src = find_vllm_dir(vllm_dir)
    dest = Path(dest)
    pkg = dest / PACKAGE
    shutil.rmtree(dest, ignore_errors=True)
    pkg.mkdir(parents=True)
    version = _vllm_version(src)
    interface, changes = rewire_interface((src / INTERFACE_SRC).read_text())
    shutil.copy2(src / SO_NAME, pkg / SO_NAME)
    (pkg / INTERFACE_NAME).write_text(interface)
    (pkg / "__init__.py").write_text(_INIT.format(version=version, so=SO_NAME))
    files = {}
    for p in sorted(pkg.iterdir()):
        files[p.name] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    manifest = {
        "schema": 1,
        "vllm_version": version,
        "source_dir": str(src),
        "sources": {SO_NAME: str(src / SO_NAME), INTERFACE_NAME: str(src / INTERFACE_SRC)},
        "interface_sha256_original": _sha256(src / INTERFACE_SRC),
        "package": PACKAGE,
        "files": files,
        "total_bytes": sum(f["bytes"] for f in files.values()),
        "changes": changes,
        "elf": elf_facts(src / SO_NAME),
    }
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# ------------------------------------------------------------------------------------------
# verify (here in the dry run, and first thing on the box)
# ------------------------------------------------------------------------------------------
def verify_bundle(dest: str | os.PathLike[str] = DEFAULT_DEST) -> dict[str, Any]:
    """Check a bundle without loading the ``.so``: every file present with its manifest
    size and sha256, the total under :data:`MAX_BUNDLE_BYTES`, no vLLM import left in the
    interface. Returns ``{"ok": bool, "problems": [...], "total_bytes", ...}``; never
    raises for a bad bundle (the check reports instead of crashing)."""
    dest = Path(dest)
    rep: dict[str, Any] = {"dir": str(dest), "ok": False, "problems": []}
    try:
        manifest = json.loads((dest / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        rep["problems"].append(f"manifest.json unreadable: {e} "
                               "(make it: python tools/gpu_flashmla/bundle.py)")
        return rep
    rep["vllm_version"] = manifest.get("vllm_version")
    pkg = dest / manifest.get("package", PACKAGE)
    total = 0
    for name, want in manifest.get("files", {}).items():
        p = pkg / name
        if not p.is_file():
            rep["problems"].append(f"{p}: missing")
            continue
        size = p.stat().st_size
        total += size
        if size != want["bytes"] or _sha256(p) != want["sha256"]:
            rep["problems"].append(f"{p}: size/sha256 differ from the manifest")
    for name in (SO_NAME, INTERFACE_NAME, "__init__.py"):
        if name not in manifest.get("files", {}):
            rep["problems"].append(f"manifest lists no {name}")
    rep["total_bytes"] = total
    if total > MAX_BUNDLE_BYTES:
        rep["problems"].append(f"bundle is {total} B, over {MAX_BUNDLE_BYTES} B")
    try:
        left = [m for m in _imports_of((pkg / INTERFACE_NAME).read_text())
                if m == "vllm" or m.startswith("vllm.")]
        if left:
            rep["problems"].append(f"{INTERFACE_NAME} imports {left}")
    except (OSError, SyntaxError) as e:
        rep["problems"].append(f"{INTERFACE_NAME}: {e}")
    rep["changes"] = manifest.get("changes")
    rep["elf"] = manifest.get("elf")
    rep["ok"] = not rep["problems"]
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-dir", help="the vllm package directory to copy from")
    ap.add_argument("--dest", default=str(DEFAULT_DEST))
    ap.add_argument("--verify", action="store_true", help="only verify an existing bundle")
    ap.add_argument("--against", action="append", default=[], metavar="LIB",
                    help="with --verify: also list the .so's torch / C++ symbols these "
                         "libraries (another torch's lib/libtorch*.so, a libstdc++.so.6) "
                         "do not define; repeatable")
    args = ap.parse_args(argv)
    if args.verify:
        rep = verify_bundle(args.dest)
        short = {k: rep[k] for k in ("dir", "ok", "problems", "total_bytes") if k in rep}
        if args.against and rep.get("elf"):
            short["unresolved"] = unresolved(rep["elf"], [Path(p) for p in args.against])
            short["ok"] = rep["ok"] and not any(short["unresolved"].values())
        print(json.dumps(short, indent=1))
        return 0 if short["ok"] else 1
    try:
        m = make_bundle(args.vllm_dir, args.dest)
    except BundleError as e:
        print(f"gpu_flashmla bundle: {e}", file=sys.stderr)
        return 2
    rep = verify_bundle(args.dest)
    print(f"gpu_flashmla bundle: vLLM {m['vllm_version']} FlashMLA in {args.dest} "
          f"({m['total_bytes'] / 2**20:.2f} MiB, {len(m['elf']['torch_stable_abi_symbols'])} "
          f"stable-ABI symbols needed from torch; verify: "
          f"{'ok' if rep['ok'] else rep['problems']})")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
