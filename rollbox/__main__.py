"""``python -m rollbox``: the ``rollbox`` command."""

import sys

from rollbox.cli import main

sys.exit(main())
