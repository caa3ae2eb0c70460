"""The handshake carries what a real NIXL READ needs: agent blob plus layer addresses.

A producer NIXL agent registers per-layer KV tensors and publishes its
metadata through a live handshake server; a consumer fetches it, loads the
agent blob, and READs one block of every layer using only the decoded
addresses and block sizes. Byte-for-byte equality proves the metadata is right.
"""

from __future__ import annotations

import time
import uuid

import numpy as np

from tests.conftest import require

torch = require("torch")
require("nixl_cu12._api", "NIXL")

from kvbridge.backends.nixl import NixlTransport, XferState, block_descs  # noqa: E402
from kvbridge.handshake import (  # noqa: E402
    AgentMetadata,
    HandshakeClient,
    HandshakeServer,
    MetadataStore,
)
from kvbridge.layouts import ParallelTopology, load_spec  # noqa: E402

NUM_BLOCKS = 4


def test_consumer_reads_producer_blocks_with_handshake_metadata_only():
    spec = load_spec("tiny-gqa")
    topology = ParallelTopology()
    (shape,) = spec.rank_shapes(topology)
    producer = NixlTransport(f"hs-producer-{uuid.uuid4().hex[:8]}")
    consumer = NixlTransport(f"hs-consumer-{uuid.uuid4().hex[:8]}")
    server = None
    try:
        generator = torch.Generator().manual_seed(7)
        layers = {layer: torch.randn(shape.tensor_shape(NUM_BLOCKS), generator=generator)
                  .to(torch.float16).contiguous() for layer in shape.layer_ids}
        producer.register_regions(list(layers.values()))
        store = MetadataStore("prefill-nixl", spec, topology)
        store.publish(AgentMetadata.build(
            "prefill-nixl", producer.name, producer.agent_metadata(), spec, topology,
            {layer: t.data_ptr() for layer, t in layers.items()}, NUM_BLOCKS))
        server = HandshakeServer(store).start()

        remote = HandshakeClient(timeout_s=5.0).fetch(server.address).metadata.rank()
        peer = consumer.add_peer(remote.agent_name, remote.agent_blob)
        (region,) = remote.regions
        bbpl = region.block_bytes_per_layer
        local = torch.zeros(len(region.base_addrs) * bbpl, dtype=torch.uint8)
        consumer.register_regions([local])
        local_list = consumer.prepare_local(0, bbpl, len(region.base_addrs))
        # block 2 of every layer, addressed purely from the handshake
        remote_rows = np.concatenate([block_descs(addr + 2 * bbpl, bbpl, 1)
                                      for addr in region.base_addrs])
        remote_list = consumer.prepare_remote(peer, remote_rows)
        count = len(region.base_addrs)
        xfer = consumer.post("READ", local_list, np.arange(count), remote_list,
                             np.arange(count), deadline_s=10.0)
        end = time.monotonic() + 10.0
        while consumer.poll(xfer) is XferState.PENDING and time.monotonic() < end:
            producer.get_notifs()  # the passive side progresses its worker
        assert xfer.state is XferState.DONE, xfer.error
        got = local.view(count, bbpl)
        for i, layer in enumerate(shape.layer_ids):
            want = layers[layer][2].contiguous().view(torch.uint8).reshape(-1)
            assert torch.equal(got[i], want), f"layer {layer} differs"
    finally:
        if server is not None:
            server.stop()
        consumer.close(strict=False)
        producer.close(strict=False)
