"""trainprobes.validation and trainprobes.errors: checks that name the argument, show the
value and say what works; one error root with the builtin a caller would catch mixed in."""
import argparse

import numpy as np
import pytest
from trainprobes import errors
from trainprobes.validation import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_type,
    parse_choice,
    parse_int,
    parse_number,
)


@pytest.mark.parametrize("value", [1, 7, np.int64(3), np.int32(2)])
def test_check_int_accepts_and_normalises(value):
    out = check_int(value, "world", min=1)
    assert out == int(value) and type(out) is int


@pytest.mark.parametrize("value, bounds, msg", [
    (0, {"min": 1}, "world=0 must be an int >= 1"),
    (True, {}, "world=True must be an int"),
    (2.0, {"min": 1}, "world=2.0 must be an int >= 1"),
    ("4", {}, "world='4' must be an int"),
    (9, {"min": 1, "max": 8}, "world=9 must be an int in [1, 8]"),
])
def test_check_int_refuses_naming_the_argument(value, bounds, msg):
    with pytest.raises(errors.InvalidArgument) as e:
        check_int(value, "world", **bounds)
    assert str(e.value) == msg
    assert isinstance(e.value, ValueError) and isinstance(e.value, errors.TrainprobesError)


def test_hint_says_what_the_argument_is():
    with pytest.raises(ValueError, match=r"world=0 must be an int >= 1 \(the number of ranks\)$"):
        check_int(0, "world", min=1, hint="the number of ranks")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.0, True, "x", None])
def test_check_number_refuses_nan_inf_bool_and_out_of_range(value):
    with pytest.raises(errors.InvalidArgument, match=r"^scale=.* must be a finite number > 0$"):
        check_number(value, "scale", min=0, min_open=True)


def test_check_number_bounds_and_infinity_on_request():
    assert check_number(3, "x", min=0, max=3) == 3.0
    assert check_number(float("inf"), "x", finite=False) == float("inf")
    with pytest.raises(errors.InvalidArgument, match=r"must be a number < 1"):
        check_number(1, "x", max=1, max_open=True, finite=False)


def test_check_choice_suggests_the_close_one():
    assert check_choice("sum", "op", ("sum", "avg")) == "sum"
    with pytest.raises(errors.InvalidArgument,
                       match=r"^mode='perturbb' must be one of \('perturb', 'truncate'\); "
                             r"did you mean 'perturb'\?$"):
        check_choice("perturbb", "mode", ("perturb", "truncate"))
    with pytest.raises(errors.InvalidArgument, match=r"op=\[1\] must be one of"):
        check_choice([1], "op", {"sum"})


def test_check_type_and_bool_raise_type_errors():
    with pytest.raises(errors.InvalidType, match=r"^metrics=\[1\] must be dict, not list$") as e:
        check_type(dict, [1], "metrics")
    assert isinstance(e.value, TypeError)
    with pytest.raises(errors.InvalidType, match="must be int, not bool"):
        check_type(int, True, "n")
    assert check_bool(False, "pack") is False
    with pytest.raises(errors.InvalidType, match=r"pack=1 must be True or False"):
        check_bool(1, "pack")


def test_parse_callables_make_argparse_exit_2_with_the_check_message(capsys):
    p = argparse.ArgumentParser(prog="tp")
    p.add_argument("--world", type=parse_int("world", min=1))
    p.add_argument("--tol", type=parse_number("tol", min=0))
    p.add_argument("--op", type=parse_choice("op", ("sum", "avg")))
    args = p.parse_args(["--world", " 4", "--tol", "0.5", "--op", "avg"])
    assert (args.world, args.tol, args.op) == (4, 0.5, "avg")
    for argv, msg in ((["--world", "0"], "argument --world: world=0 must be an int >= 1"),
                      (["--world", "four"], "world='four' must be an int >= 1"),
                      (["--tol", "nan"], "tol=nan must be a finite number >= 0"),
                      (["--op", "sun"], "op='sun' must be one of ('sum', 'avg'); did you mean 'sum'?")):
        with pytest.raises(SystemExit) as e:
            p.parse_args(argv)
        assert e.value.code == 2
        assert msg in capsys.readouterr().err


def test_every_deliberate_error_derives_from_the_root():
    import trainprobes.distributed.launcher as launcher
    import trainprobes.drift.monitor as monitor
    for cls in (errors.InvalidArgument, errors.InvalidType, errors.ConfigError, errors.TargetError,
                errors.SchemaError, errors.DataFileError, errors.CannotJudge, launcher.LaunchError,
                launcher.WorkerFailed, monitor.DriftAlarm):
        assert issubclass(cls, errors.TrainprobesError), cls
