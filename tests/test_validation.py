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
    check_seed,
    check_tensor,
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


def test_check_choice_takes_other_spellings_and_suggests_through_them():
    spellings = {"float16": "fp16", "half": "fp16"}
    assert check_choice("half", "dtype", ("fp16", "bf16"), spellings=spellings) == "fp16"
    assert check_choice(" HALF", "dtype", ("fp16",), spellings=spellings,
                        normalise=lambda s: s.strip().lower()) == "fp16"
    with pytest.raises(errors.InvalidArgument,
                       match=r"^dtype='flaot16' must be one of \('fp16', 'bf16'\); "
                             r"did you mean 'fp16'\?$"):
        check_choice("flaot16", "dtype", ("fp16", "bf16"), spellings=spellings)


@pytest.mark.parametrize("value", [0, -(2 ** 63), 2 ** 64 - 1, np.int64(7)])
def test_check_seed_accepts_torch_generator_range(value):
    import torch
    assert check_seed(value) == int(value)
    torch.Generator().manual_seed(check_seed(value))  # torch agrees


@pytest.mark.parametrize("value, exc, msg", [
    (2 ** 64, errors.InvalidArgument, r"^seed=18446744073709551616 is out of range: must be an "
                                      r"int in \[-2\*\*63, 2\*\*64\) \(a torch.Generator seed\)$"),
    (-(2 ** 63) - 1, errors.InvalidArgument, "is out of range"),
    (1.5, errors.InvalidArgument, r"^seed=1.5 must be an int \(a torch.Generator seed\)$"),
    (None, errors.InvalidArgument, r"^seed=None must be an int"),
])
def test_check_seed_refuses_what_torch_would_choke_on(value, exc, msg):
    with pytest.raises(exc, match=msg):
        check_seed(value)


def test_check_tensor_kind_shape_and_like():
    import torch
    x = torch.zeros(2, 3, 8)
    assert check_tensor(x, "logits", kind="floating", shape=(None, None, 8)) is x
    assert check_tensor(x, "logits", ndim=3) is x
    with pytest.raises(errors.InvalidType, match=r"^logits has type list, expected a torch.Tensor$"):
        check_tensor([1.0], "logits")
    with pytest.raises(errors.InvalidType,
                       match=r"^ids has dtype torch.float32, expected an integer tensor$"):
        check_tensor(x, "ids", kind="integer")
    with pytest.raises(errors.InvalidType, match=r"has dtype torch.bool, expected a real"):
        check_tensor(torch.ones(2, dtype=torch.bool), "x", kind="real")
    with pytest.raises(errors.InvalidArgument,
                       match=r"^logits has shape \(2, 3, 8\), expected \(\*, \*, 4\) \(\[B, T, E\]\)$"):
        check_tensor(x, "logits", shape=(None, None, 4), hint="[B, T, E]")
    with pytest.raises(errors.InvalidArgument, match=r"^x has shape \(2, 3, 8\), expected 2 dimensions$"):
        check_tensor(x, "x", ndim=2)
    with pytest.raises(errors.InvalidArgument,
                       match=r"^inputs\[3\] has shape \(7,\), expected \(8,\) like inputs\[0\]$"):
        check_tensor(torch.ones(7), "inputs[3]", like=(torch.ones(8), "inputs[0]"))
    with pytest.raises(errors.InvalidArgument,
                       match=r"^inputs\[1\] has dtype torch.float16, expected torch.float32 like"):
        check_tensor(torch.ones(8, dtype=torch.float16), "inputs[1]", like=(torch.ones(8), "inputs[0]"))


def test_a_family_prefix_names_the_choices_it_begins():
    # 'h200' is too short for difflib against 'h200-scaled-mm' (ratio 0.44): no suggestion
    with pytest.raises(errors.InvalidArgument, match=r"did you mean 'h200-a' or 'h200-b'\?$"):
        check_choice("h200", "presets", ["h200-a", "h200-b", "fp32"])
