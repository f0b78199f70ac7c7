"""A user's FSDP2 trainer as one module: `step` and `setup`, found by name (--step)."""
from transforms_user_steps import fsdp_setup as setup  # noqa: F401
from transforms_user_steps import fsdp_step as step  # noqa: F401
