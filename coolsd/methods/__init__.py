"""Decoding methods. Importing this package registers every built-in method."""
from coolsd.methods import ar, cspd, eagle, gsd, lantern, relaxed, sjd  # noqa: F401  (registration)
from coolsd.methods.registry import (FAMILIES, Method, build_method, check_method, method_families, method_names,
                                     method_params, register_method)

__all__ = ["FAMILIES", "Method", "build_method", "check_method", "method_families", "method_names", "method_params", "register_method"]
