"""``python -m fsync`` and the installed package."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import fsync


def test_python_m_fsync_reports_and_self_checks():
    out = subprocess.run(
        [sys.executable, "-m", "fsync"], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out[0] == f"fsync {fsync.__version__}"
    assert out[1].startswith("torch ") and "optree" in out[1]
    assert "gloo" in out[2]
    assert out[3].startswith("self-check ok:")


def test_every_public_name_is_in_the_api_reference():
    api = (pathlib.Path(__file__).parent.parent / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: (fsync[\w.]*)$", api, flags=re.M))
    import fsync.ops
    import fsync.optim

    public = {
        f"{module.__name__}.{name}"
        for module in (fsync, fsync.ops, fsync.optim)
        for name in module.__all__
        if not name.startswith("__") and not isinstance(getattr(module, name), type(fsync))
    }
    assert public - documented == set(), "add these to docs/api.md"
    assert documented - public == set(), "docs/api.md names something that is not public"


def test_public_names_are_exported_and_documented():
    import fsync.ops
    import fsync.optim

    for module in (fsync, fsync.ops, fsync.optim):
        for name in module.__all__:
            obj = getattr(module, name)
            if name.startswith("__") or isinstance(obj, type(fsync)):
                continue
            assert obj.__doc__ and obj.__doc__.strip(), f"{module.__name__}.{name} has no docstring"
