"""``python test/e2e_cpu.py``: runs ``testkit/e2e_cpu.py`` (its docstring says what and how)."""

from testkit.e2e_cpu import main

if __name__ == "__main__":
    main()
