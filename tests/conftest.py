import os

# Triton kernels run on the CPU under its interpreter; the flag must be set before triton is imported.
# Only code asked for a kernel on the CPU uses it (the runners pick kernels by default on CUDA only).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from targets import tiny_config  # noqa: F401  (tests import it from here)


@pytest.fixture
def seed():
    # fresh random inputs each run; the seed is printed so a failure can be replayed
    s = int(torch.randint(0, 2**31 - 1, ()).item())
    torch.manual_seed(s)
    print(f"seed={s}")
    return s


from test_server import models  # noqa: E402,F401  (module-scoped fixture shared with test_bench)
