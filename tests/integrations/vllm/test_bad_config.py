"""A vLLM configuration kvbridge cannot serve fails at start-up, naming the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.integrations.vllm import configs
from kvbridge.integrations.vllm import harness as h

pytestmark = pytest.mark.vllm


def test_unknown_connector_setting_fails_at_startup_naming_it(tiny_model: Path,
                                                              server_logs: Path) -> None:
    config = configs.kvbridge_nixl_config("kv_consumer", extra={"mode": "sideways"})
    server = h.VllmServer(h.ServerSpec("bad-mode", str(tiny_model), h.free_port(), core=1,
                                       kv_transfer_config=config), server_logs / "bad-config")
    server.start()
    try:
        with pytest.raises(h.HarnessError) as info:
            server.wait_ready(300)
    finally:
        server.stop()
    assert "exited" in str(info.value)
    log = server.log_path.read_text(errors="replace")
    assert "kv_connector_extra_config.mode" in log
    assert "sideways" in log
