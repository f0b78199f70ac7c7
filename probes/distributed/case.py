"""One collective call to run on real ranks (a Case), checked before any process starts.

Shared by the ranks (trainprobes.distributed.worker) and the launcher's side
(trainprobes.distributed.probe, .predict), so neither imports the other for it.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainprobes.distributed.inputs import DATA, DTYPES, torch_dtype
from trainprobes.errors import InvalidArgument
from trainprobes.reference.formats import get_format
from trainprobes.validation import check_choice, check_int

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "reduce")
OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True)
class Case:
    """One collective call: what to run, on which data. Validated before any process starts."""

    collective: str = "all_reduce"
    dtype: str = "fp32"
    op: str = "sum"
    numel: int = 4096
    data: str = "normal"
    seed: int = 0
    root: int = 0

    def __post_init__(self):
        # any spelling of a format ("bfloat16", torch.float16) becomes its canonical name,
        # the key the ranks and the emulator use; an unknown one is left for check() to name
        try:
            object.__setattr__(self, "dtype", get_format(self.dtype).name)
        except (InvalidArgument, TypeError):
            pass

    def check(self, world: int, backend: str) -> "Case":
        check_int(world, "world", min=1, hint="the number of ranks")
        check_choice(self.collective, "collective", COLLECTIVES)
        check_choice(self.op, "op", OPS)
        check_choice(self.data, "data", tuple(DATA))
        check_int(self.numel, "numel", min=1, hint="elements per rank")
        check_int(self.seed, "seed", min=0, hint="the inputs' seed")
        check_int(self.root, "root", min=0, max=world - 1, hint="a rank")
        if self.collective == "reduce_scatter" and self.numel % world:
            raise InvalidArgument(f"numel={self.numel!r} with collective='reduce_scatter' must be "
                                  f"divisible by world={world}, e.g. "
                                  f"{world * max(1, self.numel // world)}")
        if backend == "gloo" and self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype={self.dtype!r} with backend='gloo': gloo has no float8 "
                                  f"reduction (gloo: 'Invalid scalar type'); use "
                                  f"backend='emulated' or one of {list(DTYPES)}")
        if backend == "emulated":
            get_format(self.dtype)  # any format trainprobes.reference.formats knows
        else:
            torch_dtype(self.dtype)
        return self

    @property
    def label(self) -> str:
        return f"{self.collective}[{self.dtype},{self.op},n={self.numel},{self.data}]"
