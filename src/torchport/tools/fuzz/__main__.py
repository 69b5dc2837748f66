"""``python -m torchport.tools.fuzz``: see :mod:`torchport.tools.fuzz.cli`."""

import sys

from torchport.tools.fuzz.cli import main

sys.exit(main())
