"""Decoding methods. Importing this package registers every built-in method."""
from coolsd.engine.methods import ar, budget, cspd, eagle, gsd, lantern, pjd, relaxed, sjd, zipar  # noqa: F401  (registration)
from coolsd.engine.methods.registry import (
                                     FAMILIES,
                                     METHODS,
                                     Method,
                                     MethodInfo,
                                     Param,
                                     ParamError,
                                     build_method,
                                     check_method,
                                     check_params,
                                     config_node,
                                     method_families,
                                     method_info,
                                     method_names,
                                     method_params,
                                     register_method,
)

__all__ = ["FAMILIES", "METHODS", "Method", "MethodInfo", "Param", "ParamError", "build_method", "check_method", "check_params",
           "config_node", "method_families", "method_info", "method_names", "method_params", "register_method"]
