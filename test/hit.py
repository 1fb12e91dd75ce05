"""``python test/hit.py``: runs ``testkit/hit.py`` (its docstring says what and how)."""

import sys

from testkit.hit import main

if __name__ == "__main__":
    sys.exit(main())
