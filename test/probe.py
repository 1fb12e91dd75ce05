"""``python test/probe.py``: runs ``testkit/probe.py`` (its docstring says what and how)."""

from testkit.probe import main

if __name__ == "__main__":
    main()
