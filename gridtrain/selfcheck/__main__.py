"""``python3 -m gridtrain.selfcheck``: see :mod:`gridtrain.selfcheck.runner`."""

import sys

from gridtrain.selfcheck.runner import main

sys.exit(main())
