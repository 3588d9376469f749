"""Names of the torchvision stand-in: placeholders that raise when used."""

from typing import Any


class _Missing:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_Missing":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"{self._name} belongs to kvpool's torchvision stand-in (tests/sglang_support/stubs): "
                          "the real torchvision is not installed here")


def __getattr__(name: str) -> _Missing:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(f"torchvision.{name}")
