"""``python test/seal_throughput.py``: runs ``testkit/seal_throughput.py`` (its docstring says what and how)."""

from testkit.seal_throughput import main

if __name__ == "__main__":
    main()
