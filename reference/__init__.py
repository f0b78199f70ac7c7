"""Ground truth and models of real arithmetic: formats, collectives, schedules, routers, models.

No probing and no verdicts here; reference never imports probes.
"""
