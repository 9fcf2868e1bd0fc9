"""``python -m tiny_mindie`` -> :func:`tiny_mindie.cli.main`."""

import sys

from .cli import main

sys.exit(main())
