"""``python test/l3_breakdown.py``: runs ``testkit/l3_breakdown.py`` (its docstring says what and how)."""

from testkit.l3_breakdown import main

if __name__ == "__main__":
    main()
