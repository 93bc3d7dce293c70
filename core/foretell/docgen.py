"""Old path of :mod:`foretell.plugin.docgen`, kept so existing imports work.

This module *is* that one (the same module object), so names, private helpers and
monkeypatching behave as before; ``python -m foretell.docgen`` still writes the references
(docs/decisions.md, "Old module paths").
"""

import sys

from foretell.plugin import docgen

if __name__ == "__main__":
    sys.exit(docgen.main(sys.argv[1:]))
sys.modules[__name__] = docgen
