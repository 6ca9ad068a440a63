"""``python -m blockd_apps``: the ``blockd`` command (serve, demo, demo-core, load)."""

import sys

from blockd_apps.cli import main

sys.exit(main())
