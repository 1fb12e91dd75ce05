"""``python test/mooncake_loopback.py``: runs ``testkit/mooncake_loopback.py`` (its docstring says what and how)."""

from testkit.mooncake_loopback import main

if __name__ == "__main__":
    main()
