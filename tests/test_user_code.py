"""``MODULE:FUNCTION`` user code (``--difficulty``, ``--model``, ``--schedule``): one loader, one set
of messages, the user's error class and exit code."""

from __future__ import annotations

import sys

import pytest

from varlen_cli.errors import InputError, UsageError
from varlen_cli.runtime.user_code import load_function


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "varlen_uc_good.py").write_text("def f(x):\n    return x + 1\n")
    (tmp_path / "varlen_uc_exit.py").write_text("import sys\nsys.exit(4)\n")
    (tmp_path / "varlen_uc_raise.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    (tmp_path / "plain.py").write_text("def g(x):\n    return 2 * x\n")
    yield tmp_path
    for name in ("varlen_uc_good", "varlen_uc_exit", "varlen_uc_raise", "varlen_user_plain"):
        sys.modules.pop(name, None)


def test_a_module_in_the_current_directory_and_a_py_file(in_tmp):
    path_before = list(sys.path)
    assert load_function("varlen_uc_good:f", "--difficulty")(1) == 2
    assert sys.path == path_before  # the current directory was taken off again
    assert load_function(f"{in_tmp / 'plain.py'}:g", "--model", InputError)(3) == 6


@pytest.mark.parametrize("spec,error,message", [
    ("nocolon", UsageError, "--x must be MODULE:FUNCTION (got 'nocolon')"),
    (":f", UsageError, "--x must be MODULE:FUNCTION (got ':f')"),
    ("varlen_uc_good:", UsageError, "--x must be MODULE:FUNCTION (got 'varlen_uc_good:')"),
    ("varlen_uc_good:nothing", InputError, "--x varlen_uc_good:nothing: module 'varlen_uc_good' has no function "
                                           "'nothing'"),
    ("varlen_uc_missing:f", InputError, "--x varlen_uc_missing:f: cannot import module 'varlen_uc_missing': "
                                        "ModuleNotFoundError: No module named 'varlen_uc_missing'"),
    ("varlen_uc_exit:f", InputError, "--x varlen_uc_exit:f: cannot import module 'varlen_uc_exit': "
                                     "SystemExit (sys.exit(4))"),
    ("varlen_uc_raise:f", InputError, "--x varlen_uc_raise:f: cannot import module 'varlen_uc_raise': "
                                      "RuntimeError: boom"),
    ("missing.py:f", InputError, "--x missing.py:f: file missing.py does not exist"),
])
def test_bad_specs(in_tmp, spec, error, message):
    with pytest.raises(error) as info:
        load_function(spec, "--x", InputError)
    assert info.value.message == message
