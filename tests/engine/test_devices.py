"""The engine's ``device`` setting: parsed at the edge, refused where the host has no such
GPU, placed per rank, carried to engine processes, and the host-access guard's switch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvbridge.connectors import ConfigError
from kvbridge.engine import Engine, EngineConfig
from kvbridge.engine.devices import check_device, cuda_device_count, parse_device, rank_device
from kvbridge.engine.host_memory import kv_bytes_by_device, kv_cache_bytes
from kvbridge.engine.server import config_from_dict, config_to_dict
from kvbridge.engine.workload import check_outputs, make_requests
from kvbridge.layouts import ParallelTopology, load_spec
from kvbridge.layouts.kv_memory import HostAccessError, host_readable

NO_CUDA = cuda_device_count() == 0


@pytest.mark.parametrize(("given", "want"), [("cpu", "cpu"), (" CUDA ", "cuda"),
                                             ("cuda:3", "cuda:3")])
def test_device_values_are_normalised(given: str, want: str) -> None:
    assert parse_device(given) == want


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:-1", "cpu:0", "cuda:0:1", "", "tpu"])
def test_a_bad_device_names_the_setting(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(load_spec("tiny-gqa"), device=bad)
    assert info.value.field == "device" and "cpu, cuda or cuda:N" in info.value.reason


@pytest.mark.skipif(not NO_CUDA, reason="this host has CUDA: the refusal cannot be seen here")
def test_a_cuda_device_on_a_host_without_one_is_refused_before_allocating() -> None:
    for device in ("cuda", "cuda:0", "cuda:7"):
        with pytest.raises(ConfigError) as info:
            check_device(device)
        assert info.value.field == "device" and "use --device cpu" in info.value.reason
        with pytest.raises(ConfigError):  # Engine() checks before any pool or tensor
            Engine(EngineConfig(load_spec("tiny-gqa"), device=device))


def test_ranks_are_placed_one_per_gpu_and_the_estimate_splits_by_device() -> None:
    assert rank_device("cpu", 5) == torch.device("cpu")
    assert rank_device("cuda:2", 5) == torch.device("cuda", 2)
    count = cuda_device_count()
    assert rank_device("cuda", 5) == torch.device("cuda", 5 % count if count else 0)
    config = EngineConfig(load_spec("tiny-gqa"), ParallelTopology(tp_size=2), num_blocks=4)
    assert list(kv_bytes_by_device(config)) == ["cpu"]
    assert sum(kv_bytes_by_device(config).values()) < kv_cache_bytes(config)  # + bookkeeping


def test_device_and_guard_travel_to_engine_processes() -> None:
    config = EngineConfig(load_spec("tiny-gqa"), device="cpu", kv_host_guard=True)
    again = config_from_dict(config_to_dict(config))
    assert again.device == "cpu" and again.kv_host_guard is True
    assert config_from_dict({**config_to_dict(config), "device": "CUDA:1"}).device == "cuda:1"


def test_the_guard_switch_decides_what_the_engine_hands_its_connectors(monkeypatch) -> None:
    """With the guard (setting or KVBRIDGE_KV_HOST_GUARD), the KV the workers register is
    not host-readable and refuses numpy; the engine's own compute and checks still run
    (they are torch ops), and the outputs are right."""
    monkeypatch.setenv("KVBRIDGE_KV_HOST_GUARD", "1")
    guarded = EngineConfig(load_spec("tiny-gqa"), num_blocks=16)
    assert guarded.kv_host_guard
    monkeypatch.delenv("KVBRIDGE_KV_HOST_GUARD")
    assert not EngineConfig(load_spec("tiny-gqa")).kv_host_guard
    with Engine(guarded) as engine:
        layer = next(iter(engine.workers[0].caches.layers.values()))
        assert not host_readable(layer)
        with pytest.raises(HostAccessError):
            layer.numpy()
        specs = make_requests(2, prompt_tokens=40, max_tokens=2, seed=3)
        for spec in specs:
            engine.add_request(spec)
        results = engine.run_until_done()
        assert len(results) == 2 and check_outputs(results, specs) == []


@pytest.mark.parametrize("command", ["demo", "serve"])
def test_the_cli_refuses_a_missing_gpu_in_one_line(command: str) -> None:
    if not NO_CUDA:
        pytest.skip("this host has CUDA: the refusal cannot be seen here")
    extra = ["--role", "producer"] if command == "serve" else []
    done = subprocess.run([sys.executable, "-m", "kvbridge.tools.cli", command, *extra,
                           "--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvbridge {command}: device: cuda:")
