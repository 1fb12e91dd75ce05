"""Stand-in for FlashInfer on the GPU test machine, for SGLang 0.5.21's import chain.

SGLang 0.5.21 imports FlashInfer names at module load (``fp8_utils``, under
CUDA) on the way to its memory pools; 0.5.23 does not. The GPU test machine
has no FlashInfer, and the real package imports CUTLASS's DSL, cuDNN's
frontend and cuda-python, more than a bundle carries. The KV-cache path
(device pools, host pools, the controller, the JIT HiCache kernels) never
calls FlashInfer: every name here, in any submodule, is a placeholder that
raises if it is ever called, as the bundle's ``sgl_kernel`` stand-in does.

Use: ``cp -r test/gpu_stubs/flashinfer .gpu-0521/stubs/`` after
``make-bundle.sh 0.5.21 .gpu-0521`` (``README``, Tests).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.6.18"
CALLED: list[str] = []


class _Missing:
    """A FlashInfer name: attributes are more of them; a call raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        CALLED.append(self._name)
        raise NotImplementedError(f"flashinfer stand-in: {self._name} was called")

    def __repr__(self) -> str:
        return f"<flashinfer stand-in {self._name}>"


def _module_getattr(module_name: str):
    def __getattr__(name: str) -> _Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{module_name}.{name}")

    return __getattr__


__getattr__ = _module_getattr(__name__)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every ``flashinfer.X`` is a module of placeholders too."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module) -> None:
        return None


__path__: list[str] = []
sys.meta_path.insert(0, _Submodules())
