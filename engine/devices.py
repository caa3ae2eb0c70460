"""Where the reference engine's KV cache lives: the ``device`` setting, per rank.

``cpu`` keeps every rank's KV in host memory; ``cuda`` puts rank ``r`` (its worker
index) on ``cuda:(r mod n)`` of the ``n`` visible GPUs, as a serving engine puts
one rank per GPU; ``cuda:N`` puts every rank on GPU ``N``. Only the KV tensors
go there: the content function, block tables, seeds and verification results
stay on the host (the engine copies what it checks with ``.cpu()``).

Owns: parsing the setting (:func:`parse_device`, a :class:`ConfigError` naming
``device``), the refusal of a CUDA device this host does not have
(:func:`check_device`), which device a rank gets (:func:`rank_device`) and what
a GPU can give now (:func:`device_free_bytes`). May not touch: pools, tensors or
connectors.
"""

from __future__ import annotations

import re

import torch

from kvbridge.connectors import ConfigError

_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d{1,4}))?$")


def parse_device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` (normalised: lower case, no spaces)."""
    value = str(text).strip().lower()
    match = _DEVICE.match(value)
    if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
        raise ConfigError("device", f"expected cpu, cuda or cuda:N, got {text!r}")
    return value


def cuda_device_count() -> int:
    """GPUs torch can use here (0 with a CPU build of torch or no driver)."""
    try:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # a broken driver is "no GPU" here; check_device says so
        return 0


def check_device(device: str, num_ranks: int = 1) -> None:
    """Refuse a CUDA ``device`` this host cannot give, before anything is allocated."""
    device = parse_device(device)
    if device == "cpu":
        return
    count = cuda_device_count()
    if count == 0:
        build = (f"torch {torch.__version__} has no CUDA" if not torch.version.cuda
                 else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU")
        raise ConfigError("device", f"{device}: {build} on this host; use --device cpu")
    index = device.partition(":")[2]
    if index and int(index) >= count:
        raise ConfigError("device", f"{device}: this host has {count} GPU(s) "
                                    f"(cuda:0..cuda:{count - 1})")
    del num_ranks  # several ranks may share a GPU (rank r on cuda:(r mod n))


def rank_device(device: str, worker_index: int) -> torch.device:
    """The device of rank ``worker_index``'s KV for the engine setting ``device``."""
    device = parse_device(device)
    if device == "cuda":
        count = cuda_device_count()
        return torch.device("cuda", worker_index % count if count else 0)
    return torch.device(device)


def device_free_bytes(device: torch.device) -> int:
    """What GPU ``device`` can give a new allocation now (``cudaMemGetInfo``'s free)."""
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)
