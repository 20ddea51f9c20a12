"""The gateway and ``specdec.rpc`` load neither torch nor transformers (issue #44, item 3): checked in
a fresh interpreter, since this test process has both loaded already."""

from __future__ import annotations

import subprocess
import sys

CHECK = ("import gateway.server, specdec.rpc.server, sys; "
         "loaded = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
         "assert not loaded, loaded")


def test_the_gateway_and_rpc_import_neither_torch_nor_transformers():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
