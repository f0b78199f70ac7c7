"""A single-value option given twice with different values is refused (exit 2) by every
subcommand: argparse alone keeps the last value silently."""
from __future__ import annotations

import argparse

import pytest
from trainprobes.cli import build_parser, main


def _subparsers():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def _str_option(p: argparse.ArgumentParser) -> str:
    """A single-value option taking any string (a file name, a path, a label)."""
    for a in p._actions:
        if isinstance(a, argparse._StoreAction) and a.option_strings and a.type is None \
                and a.choices is None and a.nargs is None:
            return a.option_strings[-1]
    raise AssertionError(f"{p.prog} has no plain string option")


def _commands():
    """Every (sub)command line: `isolation table` as well as `drift`."""
    out = []
    for name, p in _subparsers().items():
        nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        out += [[name, n] for a in nested for n in a.choices] if nested else [[name]]
    return out


@pytest.mark.parametrize("words", _commands(), ids=" ".join)
def test_every_subcommand_refuses_a_repeated_option(words, capsys):
    p = _subparsers()[words[0]]
    for w in words[1:]:
        p = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[w]
    opt = _str_option(p)
    assert main([*words, opt, "first.x", opt, "second.x"]) == 2
    err = capsys.readouterr().err
    assert f"{opt} given twice" in err and "'first.x'" in err and "'second.x'" in err


def test_the_same_value_twice_and_repeatable_options_are_fine():
    p = _subparsers()["drift"]
    args = p.parse_args(["--alpha", "0.05", "--alpha", "0.05", "--threshold", "k3_kl=1",
                         "--threshold", "k2_kl=1"])
    assert args.alpha == 0.05 and len(args.threshold) == 2


def test_a_typed_option_is_refused_after_conversion(capsys):
    assert main(["drift", "--demo", "--alpha", "0.01", "--alpha", "0.02"]) == 2
    assert "--alpha given twice, as --alpha 0.01 and --alpha 0.02" in capsys.readouterr().err
