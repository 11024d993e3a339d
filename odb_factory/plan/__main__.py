"""`python -m odb_factory.plan`: the deprecated name of `python -m odb_factory.dry_run`."""

import sys
import warnings

from ..dry_run.__main__ import main

if __name__ == "__main__":
    warnings.warn("python -m odb_factory.plan is deprecated: use python -m odb_factory.dry_run",
                  DeprecationWarning, stacklevel=1)
    print("odb_factory.plan is deprecated: use python -m odb_factory.dry_run", file=sys.stderr)
    sys.exit(main())
