"""``python test/gpu_bundle_fit.py [DIR]``: runs ``testkit/gpu_bundle_fit.py`` (its docstring says what and how)."""

from testkit.gpu_bundle_fit import main

if __name__ == "__main__":
    main()
