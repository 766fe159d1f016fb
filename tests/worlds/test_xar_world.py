"""``target=xar_h`` / ``xar_l`` on tiny files of the released layouts (``factories.write_xar_files``:
target and draft state dicts with upstream's buffers, kl16.ckpt): the world contract."""
import factories
from target_contract import TargetContract


class TestXARContract(TargetContract):
    """The world contract (tests/target_contract.py), both sizes on the same tiny files."""

    runs = {"xar_h": ["method=cspd", "method.gamma=2", "method.mode=exact", "method.verify=prefix"],
            "xar_l": ["method=cspd", "method.gamma=3"]}
    files_fixture = "xar_files"
    files = staticmethod(factories.write_xar_files)
    overrides = staticmethod(factories.xar_overrides)
