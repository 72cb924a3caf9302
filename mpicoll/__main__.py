"""``python -m mpicoll``: the same as the ``mpicoll`` command."""

import sys

from .cli import main

sys.exit(main())
