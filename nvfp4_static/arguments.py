"""Checks of public functions' arguments that Python does not make: a flag passed as a string
(``overwrite="no"``) is truthy, and would silently do the opposite of what it says."""

__all__ = ["check_flags"]


def check_flags(function: str, **flags) -> None:
    """Refuse any of ``flags`` (``name=value``) that is not True or False, naming ``function``."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"nvfp4_static: {function}: {name}={value!r} must be True or False")
