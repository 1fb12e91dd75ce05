"""``python test/soak.py``: runs ``testkit/soak/`` (its docstring says what and how)."""

from testkit.soak import main

if __name__ == "__main__":
    main()
