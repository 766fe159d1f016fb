"""``target=toy_continuous`` on tiny toy continuous weights (``factories.build_tiny_toy_continuous``:
the shipped recipe, 2 training steps): the world contract."""
import factories
from target_contract import TargetContract


class TestToyContinuousContract(TargetContract):
    """The world contract (tests/target_contract.py); the weights default to the shipped ones, so
    there is no file to miss."""

    runs = {"toy_continuous": ["method=cspd", "method.gamma=4"]}
    files_fixture = "toy_continuous_assets"
    files = staticmethod(factories.build_tiny_toy_continuous)
    overrides = staticmethod(factories.toy_continuous_overrides)
    lists_missing_files = False
