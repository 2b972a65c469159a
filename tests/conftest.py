"""Test setup: on machines without CUDA, Triton kernels run in the interpreter."""
import os
import threading

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_the_language_once_per_launch() -> None:
    """Triton's interpreter patches the `triton.language` modules a kernel's globals hold when
    it launches the kernel, and again, in full, on every call of a @triton.jit helper from
    inside it (InterpretedFunction.__call__), though the patch of those modules is then still in
    place. That repetition was most of the CPU time of the kernel tests. Inside a launch, a
    helper whose language modules are already patched skips it now; everything else, the
    kernels' semantics included, is unchanged. Left alone where the interpreter is laid out
    otherwise."""
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original_patch = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if original_patch is None or executor is None:
        return
    original_launch = executor.__call__
    state = threading.local()
    languages: dict = {}  # function -> ids of the language modules its globals hold

    class _Nothing:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        langs = languages.get(fn)
        if langs is None:
            langs = languages[fn] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        patched = getattr(state, "patched", None)
        if patched is None:  # not inside a launch
            return original_patch(fn)
        if langs <= patched:  # a helper called by the kernel, its modules patched already
            return _Nothing()
        patched |= langs
        return original_patch(fn)

    def launch(self, *args, **kwargs):
        state.patched = set()
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            state.patched = None

    interpreter._patch_lang = patch_lang
    executor.__call__ = launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()

import pytest  # noqa: E402

from common.make_tiny import TinySizes, make_tiny, train_tokenizer  # noqa: E402
from ddtree_kernels.tree_sampling import reread_environment  # noqa: E402
from tests.servers import loopback_channel  # noqa: E402


@pytest.fixture(autouse=True)
def _kernel_settings_as_the_environment_has_them():
    """The kernels read their settings' variables once per process (`ddtree_kernels.tree_sampling.
    environment`): each test starts with them read again, any earlier test's changes undone."""
    reread_environment()


@pytest.fixture
def kernel_env(monkeypatch):
    """`kernel_env(name, value)`: a kernel setting's variable (DDTREE_KERNELS, DDTREE_PDL) set to
    `value` (None: unset) for this test, and read again at once."""
    def set_variable(name: str, value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        reread_environment()
    return set_variable


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return train_tokenizer(TinySizes().vocab)


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def tiny_pair(request, tmp_path_factory, tiny_tokenizer):
    """(target_dir, draft_dir) of a tiny random pair, for each target architecture."""
    arch = request.param
    sizes = TinySizes(arch=arch, tie_embeddings=arch == "llama")
    return make_tiny(tmp_path_factory.mktemp(f"tiny-{arch}"), seed=1, sizes=sizes, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="session")
def qwen3_pair(tmp_path_factory, tiny_tokenizer):
    return make_tiny(tmp_path_factory.mktemp("tiny-qwen3"), seed=2, sizes=TinySizes(), tokenizer=tiny_tokenizer)


# Channels to the module's own `verifier` and `drafter` server fixtures (tests/servers.py).
@pytest.fixture(scope="module")
def verifier_channel(verifier):
    with loopback_channel(verifier.port) as channel:
        yield channel


@pytest.fixture(scope="module")
def drafter_channel(drafter):
    with loopback_channel(drafter.port) as channel:
        yield channel
