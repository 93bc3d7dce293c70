"""Old path of :mod:`foretell.plugin.loader`, kept so existing imports work.

This module *is* that one (the same module object), so names, private helpers and
monkeypatching behave as before (docs/decisions.md, "Old module paths").
"""

import sys

from foretell.plugin import loader

sys.modules[__name__] = loader
