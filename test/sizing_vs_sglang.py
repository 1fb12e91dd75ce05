"""``python test/sizing_vs_sglang.py``: runs ``testkit/sizing_vs_sglang.py`` (its docstring says what and how)."""

from testkit.sizing_vs_sglang import main

if __name__ == "__main__":
    main()
