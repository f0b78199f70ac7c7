"""The probe's statistical options on a command line: one definition for `trainprobes
transforms` and the torchrun entry (trainprobes.transforms.torchrun)."""
from __future__ import annotations

import argparse

from trainprobes.validation import parse_int, parse_number


def add_step_options(p: argparse.ArgumentParser) -> None:
    """--step (a user's own parallel step) and what it declares: one definition for
    `trainprobes transforms` and the torchrun entry."""
    p.add_argument("--step", action="append", metavar="PKG.MOD[:FN]",
                   help="your own parallel step, next to --target's single-device step: a module "
                        "exposing step(model, batch, ctx) and optionally setup(model, ctx), or "
                        "'pkg.mod:fn'; imported from the current folder as `python -m` does; "
                        "repeat for several (trainprobes.transforms.UserStep)")
    p.add_argument("--setup", metavar="PKG.MOD:FN", default=None,
                   help="setup(model, ctx) -> wrapped model, run once per rank (default: the "
                        "step module's `setup`)")
    p.add_argument("--precisions", metavar="FMT[,FMT]", default="",
                   help="formats the step uses beyond the model's own, e.g. bf16 for a bf16 "
                        "all-reduce (else a correct bf16 step is judged as an fp32 one)")
    p.add_argument("--param-dtype", metavar="FMT", default=None,
                   help="the dtype the step computes with in place of the weights' (FSDP2 param_dtype)")


def user_steps(args) -> list:
    """The --step values as UserStep transforms (the current folder searched first)."""
    from trainprobes.errors import InvalidArgument
    from trainprobes.targets import search_cwd
    from trainprobes.transforms.user import UserStep
    if not args.step:
        for flag, value in (("--setup", args.setup), ("--precisions", args.precisions or None),
                            ("--param-dtype", args.param_dtype)):
            if value:
                raise InvalidArgument(f"{flag} {value} belongs to --step (your own parallel step)")
        return []
    search_cwd()
    if args.setup and len(args.step) > 1:
        raise InvalidArgument(f"--setup {args.setup} with {len(args.step)} --step values: give each "
                              f"step module its own `setup` instead")
    precisions = tuple(x.strip() for x in args.precisions.split(",") if x.strip())
    return [UserStep(s, setup_fn=args.setup, precisions=precisions, param_dtype=args.param_dtype)
            for s in args.step]


def add_probe_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=parse_int("trials", min=4), default=16,
                   help="seeded batches (default 16)")
    p.add_argument("--seed", type=parse_int("seed", min=0), default=0, help="(default 0)")
    p.add_argument("--alpha", type=parse_number("alpha", min=0, max=1, min_open=True, max_open=True),
                   default=0.01, help="false-positive rate of a verdict (default 0.01)")
    p.add_argument("--min-effect", type=parse_number("min-effect", min=0), default=1e-6,
                   help="smallest relative scale error called biased (default 1e-6)")
    p.add_argument("--noise-tol", type=parse_number("noise-tol", min=0, min_open=True), default=None,
                   help="largest relative error called rounding noise (default: by dtype)")
