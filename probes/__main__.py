"""`python -m trainprobes ...` is the `trainprobes` command."""
import sys

from trainprobes.cli import main

sys.exit(main())
