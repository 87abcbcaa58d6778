"""`python -m ingot ...`: the `ingot` command without installing the package's script."""

import sys

from ingot.cli import main

sys.exit(main())
