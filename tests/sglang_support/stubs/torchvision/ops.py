from ._missing import __getattr__  # noqa: F401
