import sys

from foretell.cli import main

sys.exit(main())
