"""``python -m torchport.tools.conformance``: see :mod:`torchport.tools.conformance.opinfo`."""

import sys

from torchport.tools.conformance.opinfo import main

sys.exit(main())
