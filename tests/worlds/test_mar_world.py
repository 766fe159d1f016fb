"""``target=mar_h`` / ``mar_l`` on tiny files of the released layouts (``factories.write_mar_files``:
target and draft ``checkpoint-last.pth``, kl16.ckpt): the world contract."""
import factories
from target_contract import TargetContract


class TestMARContract(TargetContract):
    """The world contract (tests/target_contract.py), both sizes on the same tiny files."""

    runs = {"mar_h": ["method=cspd", "method.gamma=4"],
            "mar_l": ["method=cspd", "method.gamma=4", "method.mode=exact", "method.verify=prefix"]}
    files_fixture = "mar_files"
    files = staticmethod(factories.write_mar_files)
    overrides = staticmethod(factories.mar_overrides)
