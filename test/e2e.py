"""``python test/e2e.py``: runs ``testkit/e2e.py`` (its docstring says what and how)."""

from testkit.e2e import main

if __name__ == "__main__":
    main()
