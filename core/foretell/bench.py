"""Old path of :mod:`foretell.tools.bench`, kept so existing imports work.

This module *is* that one (the same module object), so names, private helpers and
monkeypatching behave as before; ``python -m foretell.bench`` still runs the bench
(docs/decisions.md, "Old module paths").
"""

import sys

from foretell.tools import bench

if __name__ == "__main__":
    sys.exit(bench.main())
sys.modules[__name__] = bench
