"""`python -m trainprobes.zoo.one MODEL_TYPE`: one row of the map in this process, printed
as one JSON line {"model_type", "cells", "seconds", "peak_rss_mb"} (the sweep runs each model
in its own process, so a hang or a crash costs that row only)."""
from __future__ import annotations

import json
import resource
import sys
import time


def main(argv=None) -> int:
    import warnings

    import torch
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # the sweep runs one process per core
    import transformers
    transformers.logging.set_verbosity_error()
    from trainprobes.zoo.cells import row
    mt = (argv or sys.argv[1:])[0]
    t = time.perf_counter()
    cells = [c.to_dict() for c in row(mt)]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"model_type": mt, "cells": cells, "seconds": round(time.perf_counter() - t, 2),
                      "peak_rss_mb": round(rss, 1)}, allow_nan=False, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
