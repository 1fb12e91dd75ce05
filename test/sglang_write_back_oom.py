"""``python test/sglang_write_back_oom.py``: runs ``testkit/sglang_write_back_oom.py`` (its docstring says what and how)."""

from testkit.sglang_write_back_oom import main

if __name__ == "__main__":
    main()
