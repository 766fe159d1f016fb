"""Shared fixtures: ``compose`` (the job config of some overrides), tiny worlds by name (files of
the real classes in the official layouts, built once per session: ``world_overrides`` and each
target's files fixture, from the declarations of the target test modules, ``target_contract.py``),
and the theory lab's pair. The shared factories are in ``factories.py``."""
import sys
from pathlib import Path

import pytest
import torch

# tests/<folder>/ mirrors coolsd/<folder>/; the shared helpers (factories, tiny_models, ...) sit in
# tests/ and a few tests reuse another's tiny models (``from test_llamagen import ...``): every
# folder is importable whichever test runs first (basenames are unique across folders)
TESTS = Path(__file__).resolve().parent
for _d in [TESTS, *sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))]:
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

# The suite runs tiny tensors: intra-op threads only add overhead, and on a loaded 2-core
# machine OpenMP spin-waits made tiny-model tests ~50x slower.
torch.set_num_threads(1)

import factories  # noqa: E402
import target_contract  # noqa: E402
from coolsd.theory import TabularAR  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def empty_hub_cache(tmp_path_factory):
    """Tests never read the user's Hugging Face cache nor reach the hub: an empty cache of their
    own (``HF_HUB_CACHE``, subprocesses included) and ``HF_HUB_OFFLINE=1``. A hub value
    (``hf://...``, the real targets' defaults) is then 'not in the cache' unless a test fills it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_CACHE", str(tmp_path_factory.mktemp("hf_hub_cache")))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="session")
def lab_pair():
    """A target and a drafter at a moderate distance (V=3, N=4)."""
    P = TabularAR.random(3, 4, seed=0)
    R = TabularAR.random(3, 4, seed=1)
    return P, TabularAR.mix(P, R, 0.5)


@pytest.fixture(scope="session")
def compose():
    return factories.compose


@pytest.fixture
def dynamo_only(monkeypatch):
    """``torch.compile`` as Dynamo on its ``eager`` backend (``fullgraph=True``, static shapes): for
    tests of what a compiled run does around its graphs (warm-up, graph counts, records), whose
    Inductor code tests/engine/test_compiled.py generates and checks (on a CPU it takes seconds a graph)."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="eager", fullgraph=True, dynamic=False))


def _built_once(folder: str, build):
    """A session fixture: ``build(folder)`` in a fresh temporary folder, on first use."""
    @pytest.fixture(scope="session")
    def fixture(tmp_path_factory):
        return build(tmp_path_factory.mktemp(folder))

    return fixture


# Every target's tiny files, as the session fixture its test module declares (``files_fixture``,
# tests/target_contract.py): built once, on first use, whichever test asks first
DECLARED = target_contract.declarations()
for _cls in dict.fromkeys(DECLARED.values()):
    if _cls.files_fixture:
        globals()[_cls.files_fixture] = _built_once(_cls.files_fixture, _cls.files)


@pytest.fixture(scope="session")
def world_overrides(request):
    """name -> the Hydra overrides that run declared target ``name`` on its tiny files (built on
    first use; tests/target_contract.py)."""
    def get(name: str) -> list[str]:
        cls = DECLARED[name]
        files = request.getfixturevalue(cls.files_fixture) if cls.files_fixture else None
        return [f"target={name}", *cls.overrides(files)]

    return get
