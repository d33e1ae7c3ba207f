"""machine(): names the CPU, torch's CPU kernels and the versions that a wall time or a float depends on."""

from __future__ import annotations

import os
import platform

import torch

from refusion.core.machine import machine


def test_machine_names_kernels_cores_and_versions():
    m = machine()
    assert f"({torch.backends.cpu.get_cpu_capability()}" in m
    assert f"{os.cpu_count()} cores" in m
    assert m.endswith(f"Python {platform.python_version()}, torch {torch.__version__}")
