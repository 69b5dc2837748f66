"""The OpInfo conformance runner now lives in the package, :mod:`torchport.tools.conformance`
(``python -m torchport.tools.conformance``, which also takes ``--backend``); this module keeps
``python -m tests.conformance.run`` and the drivers beside it (modules, layouts) working."""

import sys

from torchport.tools.conformance.opinfo import *  # noqa: F403
from torchport.tools.conformance.opinfo import (  # noqa: F401  (the drivers' shared helpers)
    Runner,
    _alarm,
    _md,
    _read_worker,
    _short,
    _stub_expecttest,
    _Timeout,
    _uninitialized,
    add_mode_arguments,
    apply_known,
    load_op_db,
    main,
    opinfo_id,
    report_name,
    select,
    worker_path,
)

if __name__ == "__main__":
    sys.exit(main())
