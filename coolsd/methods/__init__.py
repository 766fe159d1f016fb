"""Decoding methods. Importing this package registers every built-in method."""
from coolsd.methods import ar, eagle, lantern, relaxed, sjd  # noqa: F401  (registration)
from coolsd.methods.registry import Method, build_method, method_names, method_params, register_method

__all__ = ["Method", "build_method", "method_names", "method_params", "register_method"]
