"""``python -m torchport.conformance``: see :mod:`torchport.conformance.opinfo`."""

import sys

from torchport.conformance.opinfo import main

sys.exit(main())
