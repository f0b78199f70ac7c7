import pytest
from trainprobes.targets import TargetError, load_target


def test_loads_colon_and_dot_forms():
    assert load_target("os.path:join") is __import__("os").path.join
    assert load_target("os.path.join") is __import__("os").path.join


@pytest.mark.parametrize("spec,match", [("nope_pkg_xyz:f", "cannot be imported"),
                                        ("os.path:nope", "no attribute"),
                                        ("os:sep", "expected a callable"), ("", "must be")])
def test_errors_name_the_target(spec, match):
    with pytest.raises(TargetError, match=match):
        load_target(spec)
