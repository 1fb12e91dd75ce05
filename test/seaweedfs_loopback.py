"""``python test/seaweedfs_loopback.py``: runs ``testkit/seaweedfs_loopback.py`` (its docstring says what and how)."""

from testkit.seaweedfs_loopback import main

if __name__ == "__main__":
    main()
