"""Model Runner V2 on a CPU host, for tests: Triton's interpreter stands in for a Triton CPU backend.

vLLM's CPU build runs Model Runner V2 only where Triton has a `cpu` backend (`HAS_TRITON`, fixed
when vLLM is imported). Put this directory first on PYTHONPATH and every Python process started
with it, vLLM's spawned engine and workers included, runs Triton's kernels in the interpreter
(slow: for tests only) and reports a `cpu` backend.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when each @triton.jit kernel is decorated


def _install() -> None:
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.backends.driver import DriverBase

    class InterpreterDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError("Triton's interpreter compiles nothing")

        def get_current_target(self):
            return GPUTarget("cpu", 0, 0)

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError("Triton's interpreter is not benchmarked")

    backends.setdefault("cpu", Backend(compiler=BaseBackend, driver=InterpreterDriver))


try:
    _install()
except ImportError:  # no Triton here: vLLM picks its V1 runner
    pass
