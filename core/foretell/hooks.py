"""Old path of :mod:`foretell.plugin.hooks`, kept so existing imports work.

This module *is* that one (the same module object), so names, private helpers and
monkeypatching behave as before (docs/decisions.md, "Old module paths").
"""

import sys

from foretell.plugin import hooks

sys.modules[__name__] = hooks
