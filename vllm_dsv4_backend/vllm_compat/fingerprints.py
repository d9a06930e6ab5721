# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The drift check of the vLLM symbols the plugin's layers depend on: the
mechanism (normalised source fingerprints, :func:`check`, the error
messages). The symbols themselves are listed by each layer, in its own
module, in one *drift table* (``VLLM_DRIFT`` of ``layer/cuda.py`` and of
``layer/cpu.py``).

vLLM's DeepSeek-V4 files change weekly. A copied body that silently drifts
from vLLM's would make the plugin's layer compute something vLLM no longer
does, so :func:`check` compares the source of each symbol of a layer's table
with the fingerprint recorded for the vLLM version it was read from, and
fails loudly (vLLM version, symbol, both fingerprints) when it differs.
Re-read the new vLLM source, update the override, then the table (``python -m
vllm_dsv4_backend.vllm_compat.fingerprints --layer cuda`` prints the installed
vLLM's value of each entry next to the recorded one; ``... SYMBOL...`` one
symbol's).

A drift table maps ``"module:qualname"`` to ``(roles, {vLLM minor:
fingerprint})``:

* ``roles``: a space-separated string of :data:`ROLES`: exactly one of
  ``copied`` (the layer repeats the body with only its output buffers
  changed, or relies on what it calls) and ``fenced`` (vLLM control flow the
  workspace fences' soundness rests on, not repeated), plus ``decorated``
  (vLLM decorates the method with ``eager_break_during_capture``: it must
  stay decorated, and the layer's override decorates it again) and/or
  ``source`` (fingerprinted from the module's source text, not imported: the
  CuTe DSL modules import ``cutlass``);
* one fingerprint per vLLM minor the layer supports, ``None`` where the
  symbol does not exist in that minor (checked: it must stay absent). A
  minor missing from an entry is an error (``no fingerprint recorded``), so
  every entry covers every supported version.

A table is a plain literal (strings, tuples, dicts, ``None``) so that the
tools which must not import vLLM (``tools/cuda_graph/build_stub.py``) read it
from the layer module's text (:func:`read_table`).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Mapping
from pathlib import Path

from vllm_dsv4_backend.vllm_compat import hooks

__all__ = [
    "COPIED",
    "DECORATED",
    "FENCED",
    "ROLES",
    "SOURCE",
    "DriftTable",
    "check",
    "definition",
    "definition_text",
    "fingerprint",
    "fingerprint_text",
    "read_table",
    "source_fingerprint",
    "source_params",
    "symbols",
    "validate",
]

COPIED = "copied"
FENCED = "fenced"
DECORATED = "decorated"
SOURCE = "source"
ROLES: tuple[str, ...] = (COPIED, FENCED, DECORATED, SOURCE)

# "module:qualname" -> (roles, {vLLM minor: fingerprint, or None where absent})
DriftTable = Mapping[str, tuple[str, Mapping[str, str | None]]]


def _resolve(symbol: str) -> object:
    module_name, _, qualname = symbol.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def fingerprint_text(src: str) -> str:
    """The normalisation every fingerprint uses: sha256 (16 hex) of the source's
    non-empty lines, stripped (blank lines and indentation do not count)."""
    lines = [ln.strip() for ln in src.splitlines() if ln.strip()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def fingerprint(symbol: str) -> str:
    """:func:`fingerprint_text` of ``symbol``'s source (``module:qualname``, imported)."""
    return fingerprint_text(inspect.getsource(_resolve(symbol)))


def definition(tree: ast.AST, qualname: str) -> ast.ClassDef | ast.FunctionDef | None:
    """The class or function ``qualname`` (dotted) in a parsed module; None if missing."""
    node: ast.AST = tree
    for part in qualname.split("."):
        found = None
        for child in getattr(node, "body", []):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef)) and child.name == part:
                found = child
        if found is None:
            return None
        node = found
    return node  # type: ignore[return-value]


def definition_text(text: str, node: ast.ClassDef | ast.FunctionDef) -> str:
    """``node``'s source lines in ``text``, decorators included (what
    ``inspect.getsource`` returns for it)."""
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    return "\n".join(text.splitlines()[first - 1 : node.end_lineno])


def _source_definition(module_name: str, qualname: str) -> tuple[str, ast.AST] | None:
    # From the module's file, without importing it (CuTe DSL modules import cutlass).
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        return None
    with open(spec.origin, encoding="utf-8") as f:
        text = f.read()
    node = definition(ast.parse(text), qualname)
    return None if node is None else (text, node)


def source_fingerprint(module_name: str, qualname: str) -> str | None:
    """:func:`fingerprint` of a definition read from source text (for modules
    that cannot be imported on CPU); None if it is missing."""
    found = _source_definition(module_name, qualname)
    if found is None:
        return None
    text, node = found
    return fingerprint_text(definition_text(text, node))  # type: ignore[arg-type]


def source_params(module_name: str, qualname: str) -> list[str] | None:
    """Parameter names (without ``self``) of ``qualname`` in ``module_name``'s
    source file, read with ``ast`` (the module is not imported); ``None`` if
    the file or the definition is missing."""
    found = _source_definition(module_name, qualname)
    if found is None or not isinstance(found[1], ast.FunctionDef):
        return None
    args = found[1].args
    names = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
    return [n for n in names if n != "self"]


def validate(table: DriftTable) -> None:
    """Raise ``ValueError`` unless ``table`` is a well-formed drift table (a
    mistake in the layer module, not a vLLM drift)."""
    for symbol, entry in table.items():
        module, sep, qualname = symbol.partition(":")
        if not (module and sep and qualname):
            raise ValueError(f"drift table: {symbol!r} is not 'module:qualname'")
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], Mapping)):
            raise ValueError(f"drift table: {symbol}: expected (roles, {{minor: fingerprint}})")
        roles = entry[0].split()
        if any(r not in ROLES for r in roles) or len(set(roles)) != len(roles):
            raise ValueError(f"drift table: {symbol}: roles {entry[0]!r} (known: {ROLES})")
        if (COPIED in roles) == (FENCED in roles):
            raise ValueError(f"drift table: {symbol}: roles {entry[0]!r} need exactly one of "
                             f"{COPIED!r} and {FENCED!r}")
        for minor, want in entry[1].items():
            if not (want is None or (isinstance(want, str) and len(want) == 16)):
                raise ValueError(f"drift table: {symbol}: vLLM {minor}: {want!r} is neither "
                                 "a 16-hex fingerprint nor None")


def symbols(table: DriftTable, minor: str, role: str | None = None) -> tuple[str, ...]:
    """The symbols of ``table`` that exist in vLLM ``minor`` (a fingerprint,
    not ``None``), in table order; only those with ``role`` when given."""
    return tuple(s for s, (roles, hashes) in table.items()
                 if hashes.get(minor) is not None and (role is None or role in roles.split()))


def read_table(path: str | Path, name: str = "VLLM_DRIFT") -> dict:
    """The drift table ``name`` of a layer module, read from its source text
    with ``ast.literal_eval`` (the module, which imports vLLM, is not
    imported)."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if node.value is not None and any(isinstance(t, ast.Name) and t.id == name
                                          for t in targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{path}: no module-level {name} = {{...}}")


def _exists(symbol: str, roles: str) -> bool:
    module_name, _, qualname = symbol.partition(":")
    if SOURCE in roles.split():
        return _source_definition(module_name, qualname) is not None
    try:
        _resolve(symbol)
    except (AttributeError, ImportError):
        return False
    return True


def check(table: DriftTable, minor: str, *, decorated_on: type | None = None) -> None:
    """Raise ``PatchError`` unless every symbol of a layer's drift ``table``
    has its fingerprint for vLLM ``minor`` (e.g. ``"0.33"``), every symbol
    recorded as absent there (``None``) is absent, and every ``decorated``
    method is still decorated (looked up on ``decorated_on``, the vLLM class
    the layer subclasses, when given; else the symbol itself)."""
    validate(table)
    if not any(minor in hashes for _, hashes in table.values()):
        raise hooks.fail("copied vLLM bodies", f"no fingerprints recorded for vLLM {minor}.x")
    for symbol, (roles, hashes) in table.items():
        if minor not in hashes:
            raise hooks.fail(symbol, f"no fingerprint recorded for vLLM {minor}.x")
        want = hashes[minor]
        if want is None:
            if _exists(symbol, roles):
                raise hooks.fail(symbol, f"exists, but the plugin was written against a vLLM "
                                 f"{minor}.x without it; the plugin must be re-read against it")
            continue
        if SOURCE in roles.split():
            module_name, _, qualname = symbol.partition(":")
            got = source_fingerprint(module_name, qualname)
            if got != want:
                raise hooks.fail(
                    f"{module_name}.{qualname}",
                    f"its source changed (fingerprint {got}, the plugin's copy was written "
                    f"against {want}); the plugin's copy of this body must be re-read",
                )
            continue
        try:
            got = fingerprint(symbol)
        except (AttributeError, ImportError, OSError, TypeError) as e:
            raise hooks.fail(symbol, f"cannot be read ({e})") from e
        if got != want:
            raise hooks.fail(
                symbol,
                f"its source changed (fingerprint {got}, the plugin's override was written "
                f"against {want}); the plugin's copy of this body must be re-read",
            )
    for symbol in symbols(table, minor, DECORATED):
        qualname = symbol.partition(":")[2]
        name = qualname.rsplit(".", 1)[-1]
        target = (getattr(decorated_on, name, None) if decorated_on is not None
                  else _resolve(symbol))
        if not hasattr(target, "__wrapped__"):
            raise hooks.fail(
                qualname, "is missing or no longer decorated with eager_break_during_capture")


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - a developer's tool
    ap = argparse.ArgumentParser(
        description="Print the installed vLLM's fingerprints: of symbols, or of every entry "
                    "of a layer's drift table next to the recorded one.")
    ap.add_argument("--layer", choices=("cuda", "cpu"), help="a layer's drift table")
    ap.add_argument("symbol", nargs="*", help="module:qualname (imported)")
    args = ap.parse_args(argv)
    for s in args.symbol:
        print(f'"{s}": "{fingerprint(s)}",')
    if args.layer:
        import vllm

        minor = ".".join(str(vllm.__version__).split(".")[:2])
        path = Path(__file__).resolve().parent.parent / "layer" / f"{args.layer}.py"
        for s, (roles, hashes) in read_table(path).items():
            module_name, _, qualname = s.partition(":")
            if not _exists(s, roles):
                got = None
            elif SOURCE in roles.split():
                got = source_fingerprint(module_name, qualname)
            else:
                got = fingerprint(s)
            want = hashes.get(minor, "(none recorded)")
            print(f"{'ok' if got == want else 'DIFFERS':7s} {s}  [{roles}]  "
                  f"vLLM {minor}: {got}  recorded: {want}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
