"""Fault injection on a real mooncake_master: killed -> bounded error results; restarted -> works again.

The master is this module's own (``mooncake_master_fresh``) so killing it
cannot disturb other tests. "Bounded" is checked by outcome, not by a clock: the
client's counters say which path answered (the reachability check, the client's own
deadline, or Mooncake); pytest-timeout catches a hang.
"""

from __future__ import annotations

import time

import pytest

from kvbridge.backends.mooncake import (
    KeyStatus,
    McStatus,
    MooncakeConfig,
    MooncakeSetupError,
    MooncakeStoreClient,
)
from kvbridge.backends.mooncake.master import MooncakeMaster
from tests.conftest import require

torch = require("torch")
require("mooncake.store", "Mooncake (mooncake-transfer-engine-non-cuda)")

MiB = 1 << 20
OP_TIMEOUT_S = 1.0


def _config(master: MooncakeMaster, *, check_first: bool) -> MooncakeConfig:
    return MooncakeConfig(
        master.rpc_address,
        master.metadata_url,
        global_segment_size=16 * MiB,
        local_buffer_size=16 * MiB,
        op_timeout_s=OP_TIMEOUT_S,
        check_master_before_ops=check_first,
    )


def test_killed_master_gives_bounded_errors_and_restart_recovers(
    mooncake_master_fresh: MooncakeMaster,
) -> None:
    master = mooncake_master_fresh
    src = torch.randint(0, 255, (4, 16 << 10), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    keys = [f"kvbridge-test/fault/{i}" for i in range(4)]
    ptrs, dst_ptrs, sizes = (
        [src[i].data_ptr() for i in range(4)], [dst[i].data_ptr() for i in range(4)], [src[0].nbytes] * 4,
    )
    # Two clients on one master: one fails fast on the reachability check, the other
    # goes straight to Mooncake and relies on the deadline.
    with MooncakeStoreClient(_config(master, check_first=True)) as checked, MooncakeStoreClient(
        _config(master, check_first=False)
    ) as unchecked:
        for c in (checked, unchecked):
            c.register_buffer(src.data_ptr(), src.nbytes)
            c.register_buffer(dst.data_ptr(), dst.nbytes)
        assert all(r.ok for r in checked.batch_put_from(keys, ptrs, sizes))
        assert checked.is_master_reachable()

        master.kill()
        assert not checked.is_master_reachable()

        failed = checked.batch_get_into(keys, dst_ptrs, sizes)
        assert [r.code for r in failed] == [McStatus.MASTER_UNREACHABLE] * 4
        assert checked.batch_exists(keys) == [False] * 4  # a failed check is a miss
        # both refused by the reachability check: no call reached Mooncake (none timed out)
        assert checked.stats().unreachable == 2 and checked.stats().timeouts == 0

        # Without the check each call blocks inside Mooncake (~4.4 s per RPC to a dead
        # master); the caller still gets per-key errors within op_timeout_s.
        for call in (
            lambda: unchecked.batch_put_from(keys, ptrs, sizes),
            lambda: unchecked.batch_get_into(keys, dst_ptrs, sizes),
            lambda: unchecked.batch_exists_results(keys),
            lambda: unchecked.batch_put_from(keys, ptrs, sizes),
        ):
            before = unchecked.stats().timeouts
            results = call()
            assert len(results) == 4 and all(r.status is KeyStatus.ERROR for r in results)
            codes = {r.code_name for r in results}
            assert codes <= {"TIMEOUT", "RPC_FAIL"}, codes
            # TIMEOUT is the client's own deadline answering (counted), not Mooncake's
            assert ("TIMEOUT" in codes) == (unchecked.stats().timeouts == before + 1), codes
        assert unchecked.stats().timeouts > 0, "no call was cut short by op_timeout_s"
        assert unchecked.stats().unreachable == 0  # this client never checks first
        assert unchecked.wait_idle(15.0)  # abandoned calls end (Mooncake bounds them itself)
        assert not dst.any()  # the failed gets wrote nothing, not even late

        master.restart()
        # Clients re-mount their segments by themselves; puts fail with
        # NO_AVAILABLE_HANDLE until then. Poll, bounded.
        deadline = time.monotonic() + 20.0
        while True:
            put = checked.batch_put_from(keys[:1], ptrs[:1], sizes[:1])
            if put[0].ok or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert put[0].ok, str(put[0])
        # The restarted master lost every key it had.
        assert checked.batch_exists(keys) == [True, False, False, False]
        got = unchecked.batch_get_into(keys[:2], dst_ptrs[:2], sizes[:2])
        assert [r.status for r in got] == [KeyStatus.OK, KeyStatus.NOT_FOUND]
        assert torch.equal(dst[0], src[0])
        assert all(r.ok for r in unchecked.batch_put_from(keys[1:], ptrs[1:], sizes[1:]))
        assert checked.batch_exists(keys) == [True] * 4


def test_paused_master_times_out_ops_and_refuses_new_setup_fast(
    mooncake_master_fresh: MooncakeMaster, mooncake_setups: list[str],
) -> None:
    master = mooncake_master_fresh
    src = torch.randint(0, 255, (2, 4096), dtype=torch.uint8)
    keys = ["kvbridge-test/paused/0", "kvbridge-test/paused/1"]
    ptrs, sizes = [src[0].data_ptr(), src[1].data_ptr()], [4096, 4096]
    with MooncakeStoreClient(_config(master, check_first=True)) as client:
        client.register_buffer(src.data_ptr(), src.nbytes)
        rows = torch.zeros((512, 64), dtype=torch.uint8)  # registered before the pause
        client.register_buffer(rows.data_ptr(), rows.nbytes)
        assert all(r.ok for r in client.batch_put_from(keys, ptrs, sizes))
        master.pause()
        try:
            # The kernel still accepts TCP connections, so the cheap check passes;
            # the deadline is what bounds the call.
            assert client.is_master_reachable()
            # Keys this client never touched (nothing a client-side cache could answer).
            fresh = ["kvbridge-test/paused/never-0", "kvbridge-test/paused/never-1"]
            for call in (
                lambda: client.batch_exists_results(fresh),
                lambda: client.batch_put_from(fresh, ptrs, sizes),
                lambda: client.start_batch_get_into(fresh, ptrs, sizes).results(),
            ):
                results = call()  # TIMEOUT: the client's deadline answered, not Mooncake
                assert [r.code for r in results] == [McStatus.TIMEOUT] * 2
            assert client.stats().timeouts == 3
            # a batch cut into two calls: every key of both parts TIMEOUT, in key order
            cut = client.batch_put_from([f"kvbridge-test/paused/cut-{i}" for i in range(512)],
                                        [rows[i].data_ptr() for i in range(512)], [64] * 512)
            assert [r.code for r in cut] == [McStatus.TIMEOUT] * 512
            assert client.stats().timeouts == 5 and client.stats().cut_batches == 1
            # A new client must not enter Mooncake's setup() (minutes, GIL held).
            mooncake_setups.clear()  # (the first client's setup was real and counted)
            with pytest.raises(MooncakeSetupError, match="does not answer HTTP"):
                MooncakeStoreClient.connect(_config(master, check_first=True))
            assert mooncake_setups == [], "entered Mooncake's setup() against a stalled master"
        finally:
            master.resume()
        assert client.wait_idle(15.0)
        assert client.batch_exists(keys) == [True, True]
