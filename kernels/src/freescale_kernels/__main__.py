"""``python -m freescale_kernels ...``: the same as ``freescale kernels ...``."""

import sys

from freescale_kernels.cli import main

sys.exit(main())
