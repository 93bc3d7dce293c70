"""Old path of :mod:`foretell.tools.synthetic`, kept so existing imports work.

This module *is* that one (the same module object), so names, private helpers and
monkeypatching behave as before (docs/decisions.md, "Old module paths").
"""

import sys

from foretell.tools import synthetic

sys.modules[__name__] = synthetic
