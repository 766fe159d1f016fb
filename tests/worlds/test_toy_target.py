"""``target=toy`` on its shipped weights: the world contract, and the missing-files check on the one
file it can miss, a drafter named by path."""
from target_contract import TargetContract


class TestToyContract(TargetContract):
    """The world contract (tests/target_contract.py); the toy has no files of its own, so the
    missing-files check names a drafter folder that is not there."""

    runs = {"toy": ["method=coolsd"]}
    missing_overrides = ("draft=llamagen_xl", "draft.path=/nowhere/drafter")
    missing_names = ("drafter",)
