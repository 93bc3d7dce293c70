"""Old path of :mod:`foretell.model.loading`, kept so existing imports work.

This module *is* that one (the same module object), so names, private helpers and
monkeypatching behave as before (docs/decisions.md, "Old module paths").
"""

import sys

from foretell.model import loading

sys.modules[__name__] = loading
