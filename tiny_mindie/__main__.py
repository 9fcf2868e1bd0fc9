"""``python -m tiny_mindie`` -> :func:`tiny_mindie.cli.main`; ``python -m tiny_mindie health``
straight to :mod:`tiny_mindie.cli.health`, without the server's imports (an exec probe must
start fast)."""

import sys

if sys.argv[1:2] == ["health"]:
    from .cli.health import main

    sys.exit(main(sys.argv[2:]))

from .cli.main import main  # noqa: E402

sys.exit(main())
