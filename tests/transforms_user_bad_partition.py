"""A user's step module whose declared partition does not tile its parameter: a replicated
model (DDP) declaring 0.weight split along dim 0 over both ranks (each holds all 8 rows,
the pieces would make 16). Imported by the ranks by name (tests/test_transforms_cli.py)."""
from trainprobes.transforms.readout import Partition
from transforms_review_steps import dp_step as step  # noqa: F401
from transforms_review_steps import plain_ddp_setup as setup  # noqa: F401

partitions = {"0.weight": Partition(0)}
