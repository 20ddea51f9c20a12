"""The gateway and ``specdec.rpc`` load neither torch nor transformers (issue #44, item 3): checked in
a fresh interpreter, since this test process has both loaded already."""

from __future__ import annotations

import subprocess
import sys

# Every module of gateway/ and specdec/rpc/, the sessions plumbing the model services share included.
CHECK = ("import importlib, pkgutil, sys, gateway, specdec.rpc; "
         "[importlib.import_module(f'{package.__name__}.{module.name}') for package in (gateway, specdec.rpc) "
         "for module in pkgutil.iter_modules(package.__path__)]; "
         "loaded = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
         "assert not loaded, loaded")


def test_the_gateway_and_rpc_import_neither_torch_nor_transformers():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_no_module_there_imports_torch_or_transformers_even_lazily():
    """A lazy import inside a function would load torch the first time that function runs."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = []
    for path in sorted([*root.joinpath("gateway").glob("*.py"), *root.joinpath("specdec", "rpc").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(root)}:{node.lineno} {name}" for name in names
                      if name.split(".")[0] in ("torch", "transformers")]
    assert not found, found
