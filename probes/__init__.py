"""trainprobes: find the numerics and causality bugs that make large training runs fail.

    from trainprobes import causality, drift, numerics
    from trainprobes.reference import formats, collectives

The repository folder probes/ is this package and reference/ is `trainprobes.reference`
(pyproject's package-dir). Importing it stays cheap (no torch): the pytest plugin lives here,
so subpackages load only when first used.
"""
import importlib

if __name__ != "trainprobes":
    # Imported as 'probes' from a checkout's root: a second copy of every module (and of
    # every class, so isinstance checks between the two fail). Refuse instead.
    raise ImportError(f"this folder is the package 'trainprobes'; import trainprobes, not {__name__!r} "
                      f"(pip install -e . in the checkout makes it importable)")

from trainprobes._version import __version__  # noqa: E402

_SUBPACKAGES = ("audit", "causality", "distributed", "drift", "numerics", "reference", "report")
__all__ = ["Result", "__version__", *_SUBPACKAGES]


def __getattr__(name):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "Result":
        from trainprobes.result import Result
        return Result
    raise AttributeError(f"module 'trainprobes' has no attribute {name!r}")
