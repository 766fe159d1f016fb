"""``target=tabular``, the theory lab's world (seeded random tabular AR models): the world contract."""
from target_contract import TargetContract


class TestTabularContract(TargetContract):
    """The world contract (tests/target_contract.py): its 3 prompts are its 3 (target, draft) pairs
    (``target.pairs``), not ``dataset.n_prompts``; it has no files."""

    runs = {"tabular": ["method=coolsd", "target.n_samples=500"]}
    sets_n_prompts = False
    lists_missing_files = False
