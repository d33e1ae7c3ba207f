"""The one gate through which decoding loops read device tensors on the host.

On a GPU, turning a tensor into a Python value (``.tolist()``, ``.item()``, ``int(t)``, ``if t:``) waits
for every queued kernel: a host synchronisation. Decoders keep proposals, scores, selections, verdicts
and caches on the model's device and read values only where Python control flow needs a number (how
many slots were chosen, how long the accepted prefix is, whether a row has finished). Each such read
goes through :func:`to_host`, which moves several tensors in ONE transfer and counts it, so the number
of synchronisations per iteration is a documented, tested property of each decoder (docs/decoders.md).
The other direction, host values into device tensors, goes through :func:`from_host`, which does not
wait for the device.
"""

from __future__ import annotations

from torch import Tensor
import torch

#: host reads since the process started (or since the last :func:`reset`); read by tests and
#: ``refusion profile``
count = 0


def reset() -> int:
    """Set the counter to zero; return what it held."""
    global count
    held, count = count, 0
    return held


def to_host(*tensors: Tensor) -> list:
    """One device-to-host transfer of all ``tensors`` (one synchronisation); each comes back as a Python
    value: a number for a 0-d tensor, else a (nested) list. Integer and bool tensors keep their type."""
    global count
    count += 1
    if len(tensors) == 1:
        return [tensors[0].tolist()]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])  # exact for ints below 2**53
    values = flat.tolist()
    out, at = [], 0
    for t in tensors:
        n = t.numel()
        part = values[at : at + n]
        at += n
        if t.dtype == torch.bool:
            part = [v != 0 for v in part]
        elif not t.dtype.is_floating_point:
            part = [int(v) for v in part]
        out.append(part[0] if t.dim() == 0 else _reshape(part, list(t.shape)))
    return out


def from_host(values, device: torch.device | str, dtype: torch.dtype | None = None) -> Tensor:
    """A tensor of host ``values`` (a list or nested list) on ``device``, copied without waiting for the
    device's queue (``torch.tensor(values, device=cuda)`` would synchronise the stream after its copy)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _reshape(values: list, shape: list[int]) -> list:
    if len(shape) <= 1:
        return values
    step = len(values) // shape[0] if shape[0] else 0
    return [_reshape(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]
