"""Old path of :mod:`foretell.plugin.pytest_plugin`, kept so existing imports work.

This module *is* that one (the same module object), so names, private helpers and
monkeypatching behave as before (docs/decisions.md, "Old module paths").
"""

import sys

from foretell.plugin import pytest_plugin

sys.modules[__name__] = pytest_plugin
