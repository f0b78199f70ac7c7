"""Ground truth and models of real arithmetic: formats, collectives, schedules, routers, models.

No probing and no verdicts here; trainprobes.reference never imports the probes.
"""
if __name__ != "trainprobes.reference":
    raise ImportError(f"this folder is the package 'trainprobes.reference'; import it by that "
                      f"name, not {__name__!r}")
