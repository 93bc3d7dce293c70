"""Old path of :mod:`foretell.model.attention`, kept so existing imports work.

This module *is* that one (the same module object), so names, private helpers and
monkeypatching behave as before (docs/decisions.md, "Old module paths").
"""

import sys

from foretell.model import attention

sys.modules[__name__] = attention
