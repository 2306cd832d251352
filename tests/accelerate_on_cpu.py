"""Run a script under Accelerate's FSDP on the CPU (test use only): `accelerate launch ...
tests/accelerate_on_cpu.py SCRIPT ARGS...`.

Accelerate (1.15) enables FSDP only on GPU-like distributed types: on the CPU (MULTI_CPU) it drops
the FSDP plugin without a word and the Trainer wraps the model in DDP. Here, when Accelerate's state
is made with an FSDP plugin on the CPU, the distributed type is set to FSDP and the plugin kept, as
the GPU path does; the rest (the Trainer, `accelerator.prepare`, FSDP2 on gloo) is Accelerate's own.
Then SCRIPT runs as `__main__`.
"""

from __future__ import annotations

import runpy
import sys

from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

_made = AcceleratorState.__init__


def _init(self, *args, fsdp_plugin=None, **kwargs):  # type: ignore[no-untyped-def]
    _made(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


AcceleratorState.__init__ = _init  # type: ignore[method-assign]

if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
