import os
import sys

import pytest
from trainprobes.targets import TargetError, load_target


def test_loads_colon_and_dot_forms():
    assert load_target("os.path:join") is __import__("os").path.join
    assert load_target("os.path.join") is __import__("os").path.join
    # without a colon the longest importable module wins: a class's method works too
    from collections import OrderedDict
    assert load_target("collections.OrderedDict.fromkeys") == OrderedDict.fromkeys
    assert load_target("collections:OrderedDict.fromkeys") == OrderedDict.fromkeys


@pytest.mark.parametrize("spec,match", [
    ("nope_pkg_xyz:f", "module 'nope_pkg_xyz' cannot be imported (no such module on sys.path)"),
    ("os.path:nope", "'os.path' has no attribute 'nope'"),
    ("os.path:joi", "did you mean 'join'?"),
    ("os.path.joi", "did you mean 'join'?"),
    ("os:sep", "is a str, expected a callable"),
    ("os.path", "is a module, expected a callable (a module: name the function in it"),
    ("os", "must be 'package.module:function' (a module and the callable in it)"),
    ("", "must be"), ("a:b:c", "must be"), (":f", "must be"), ("os:", "must be"),
    # a file's path: importlib said "a relative import needs the 'package' argument"
    ("./model.py:fn", "name the module, not the file: e.g. 'model:function'"),
    ("src/model:fn", "name the module, not the file: e.g. 'model:function'"),
    ("./model.py", "name the module, not the file: e.g. 'model:function'"),
    ("src\\model:fn", "name the module, not the file: e.g. 'model:function'"),
    ("C:\\src\\model.py:fn", "name the module, not the file: e.g. 'model:function'"),
    (".model:fn", "a relative module name cannot be imported on its own"),
])
def test_errors_name_the_target(spec, match):
    with pytest.raises(TargetError, match=match.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        load_target(spec)


def test_a_module_that_fails_to_import_is_not_called_missing(tmp_path, monkeypatch):
    (tmp_path / "needs_dep.py").write_text("import no_such_dependency_xyz\ndef f(): pass\n")
    (tmp_path / "broken_mod.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TargetError, match="module 'needs_dep' was found, but importing it failed: "
                                          "ModuleNotFoundError"):
        load_target("needs_dep:f")
    with pytest.raises(TargetError, match="importing it raised SyntaxError"):
        load_target("broken_mod:f")


def test_from_cwd_searches_the_current_directory_as_python_m_does(tmp_path, monkeypatch):
    (tmp_path / "here_mod.py").write_text("def f(x):\n    return x\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "here_mod", raising=False)
    with pytest.raises(TargetError, match="'here_mod' is in the current directory but not on "
                                          "sys.path"):
        load_target("here_mod:f")
    assert load_target("here_mod:f", from_cwd=True)(3) == 3
    assert sys.path[0] == os.getcwd()
    sys.modules.pop("here_mod", None)
