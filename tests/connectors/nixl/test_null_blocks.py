"""Positions an engine holds no block at (vLLM's null block, where a sliding window
dropped the prefix) are never moved nor verified, and what a producer no longer
holds is never served.

Measured on real vLLM (hybrid model, window 64, blocks of 32, prompt of 150
tokens): a consumer allocates the null block at the two leading positions of the
sliding-window group; pushing into them wrote two different blocks to one
destination, and the digest of whichever landed first failed the load about one
time in thirty under load. A producer's vLLM releases the out-of-window prefix as
the request finishes (its window is one token ahead of the consumer's): when that
leaves a block the consumer still attends, the load must fail, not read the
null block's bytes.
"""

from __future__ import annotations

from kvbridge.connectors import ConnectorConfig, ConnectorContext, ConnectorRequest, KVRole
from kvbridge.connectors.nixl.plugin import NixlPlugin
from kvbridge.connectors.params import TransferMode, TransferParams
from kvbridge.connectors.pd.scheduler import PdMetadata, PdScheduler
from kvbridge.connectors.pd.send_state import PushJob
from kvbridge.connectors.step import SchedulerStep
from kvbridge.layouts import ParallelTopology, hash_blocks, load_spec

MODEL = "tiny-hybrid"
NULL = 0


def _scheduler(role: KVRole, mode: TransferMode, engine: str) -> PdScheduler:
    spec = load_spec(MODEL)
    extra = {"mode": mode.value}
    config = ConnectorConfig("nixl", role, extra=extra, engine_id=engine)
    ctx = ConnectorContext(spec=spec, topology=ParallelTopology(), config=config,
                           num_blocks=tuple(64 for _ in spec.regions),
                           extra=NixlPlugin.parse_extra(extra), null_block_id=NULL)
    sched = NixlPlugin.create_scheduler(ctx)
    assert isinstance(sched, PdScheduler)
    return sched


def _request(rid: str, prompt: tuple[int, ...], sched: PdScheduler, **kw: object
             ) -> ConnectorRequest:
    hashes = tuple(tuple(hash_blocks(prompt, sched.ctx.block_tokens(r)))
                   for r in range(len(sched.ctx.spec.regions)))
    return ConnectorRequest(rid, prompt, len(prompt), hashes, **kw)  # type: ignore[arg-type]


def _step(sched: PdScheduler) -> PdMetadata:
    meta = sched.build_connector_meta(SchedulerStep(step_id=1, scheduled=()))
    assert isinstance(meta, PdMetadata)
    return meta


def _blocks(n: int, base: int, nulls: int) -> tuple[int, ...]:
    return tuple(NULL if i < nulls else base + i for i in range(n))


def _pulled(producer_nulls: int, consumer_nulls: int) -> PdMetadata:
    """A 150-token prompt prefilled on a producer whose block table names ``producer_nulls``
    null blocks in region 0, loaded by a consumer with ``consumer_nulls`` there."""
    prompt = tuple(range(7, 157))
    producer = _scheduler(KVRole.PRODUCER, TransferMode.PULL, "prod")
    consumer = _scheduler(KVRole.CONSUMER, TransferMode.PULL, "cons")
    n = [-(-len(prompt) // producer.ctx.block_tokens(r))
         for r in range(len(producer.ctx.spec.regions))]
    assert n[0] == 10  # blocks of 16 tokens
    with_token = _request("p", prompt + (1,), producer)
    done = ConnectorRequest("p", with_token.token_ids, len(prompt), with_token.block_hashes,
                            num_computed_tokens=len(prompt), remote_decode=True)
    held = tuple(_blocks(n[r], 10, producer_nulls if r == 0 else 0) for r in range(len(n)))
    delay, params = producer.request_finished(done, held)
    assert delay and isinstance(params, TransferParams)
    request = _request("c", prompt, consumer, transfer_params=params)
    ext, asynchronous = consumer.get_num_new_matched_tokens(request, 0)
    assert ext and asynchronous
    ids = tuple(_blocks(n[r], 40, consumer_nulls if r == 0 else 0) for r in range(len(n)))
    consumer.update_state_after_alloc(request, ids, min(ext, len(prompt) - 1))
    return _step(consumer)


def test_a_consumer_loads_from_its_first_real_block() -> None:
    meta = _pulled(producer_nulls=2, consumer_nulls=2)
    (load,) = meta.loads
    assert load.error is None
    assert load.start[0] == 2
    assert load.consumer_block_ids[0] == tuple(40 + i for i in range(2, 10))
    assert load.producer_block_ids[0] == tuple(10 + i for i in range(2, 10))
    assert all(s == 0 for s in load.start[1:])  # the other regions: every block


def test_a_block_the_producer_released_but_the_consumer_attends_fails_the_load() -> None:
    (load,) = _pulled(producer_nulls=3, consumer_nulls=2).loads
    assert load.error is not None and "no longer holds block index 2" in load.error


def test_a_push_never_writes_a_position_its_engine_released() -> None:
    job = PushJob("r", ((11, 12, 13, 14, 15), (21, 22, 23, 24, 25)))
    job.release(((NULL, NULL, 13, 14, 15), (21, 22, 23, 24, 25)), NULL)
    assert job.released == {(0, 0), (0, 1)}
    other = PushJob("s", ((0, 12, 13),))
    other.release(((0, 12, 13),), None)  # an engine without a null block releases nothing
    assert other.released == frozenset()
