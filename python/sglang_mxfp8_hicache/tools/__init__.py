"""The tools a person runs: ``check``, ``size`` and ``bench`` (L2 and L3).

The core a server imports never imports this package; what only the tests use
(kernel emulation, the full round trip, the e2e harness) is in ``test/testkit``.
"""
