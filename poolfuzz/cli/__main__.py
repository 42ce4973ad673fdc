"""``python -m poolfuzz.cli``: the same command line as the ``poolfuzz`` script."""

import sys

from poolfuzz.cli import main

sys.exit(main())
