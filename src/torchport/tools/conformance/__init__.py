"""Conformance of a backend against the CPU over PyTorch's OpInfo database.

``python -m torchport.tools.conformance --backend NAME`` runs it against any backend (``sim``, a
``torchport.backends`` name, or the module path of a vendor's backend) and writes
``reports/conformance.{json,md}``; ``docs/conformance.md`` and ``docs/vendor-guide.md``
say how to read them. The runner is :mod:`torchport.tools.conformance.opinfo`.
"""

from torchport.tools.conformance.opinfo import (
    DEFAULT_DTYPES,
    KNOWN,
    SUBSET,
    SUBSET_DTYPES,
    SUBSET_MAX_SAMPLES,
    Runner,
    load_op_db,
    main,
    run_in_process,
    select,
    write_reports,
)

__all__ = ["DEFAULT_DTYPES", "KNOWN", "SUBSET", "SUBSET_DTYPES", "SUBSET_MAX_SAMPLES", "Runner",
           "load_op_db", "main", "run_in_process", "select", "write_reports"]
