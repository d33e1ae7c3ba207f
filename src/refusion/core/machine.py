"""A one-line description of the machine a run happens on, for records and docs.

Wall times and even float round-off depend on it: torch picks its CPU kernels by instruction set
(``AVX2``, ``AVX512``), and two hosts with the same CPU name but different kernels can differ in speed
and in the last digits of a training loss. Stage records (``stage.json``) and the training log's ``start`` records
carry this string.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine() -> str:
    """``"<cpu model> (<torch CPU kernels>[, <accelerator>]), <n> cores, <OS>, Python <v>, torch <v>"``."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    kernels = [torch.backends.cpu.get_cpu_capability()]
    if torch.cuda.is_available():
        kernels.append(torch.cuda.get_device_name(0))
    return (f"{cpu} ({', '.join(kernels)}), {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")
