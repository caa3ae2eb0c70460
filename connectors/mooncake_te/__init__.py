"""The ``mooncake_te`` prefill/decode connector: the PD core over Mooncake's transfer engine.

The second adapter of :mod:`kvbridge.connectors.pd` (NIXL's is
:mod:`kvbridge.connectors.nixl`): the same protocol, sessions, leases,
verification, pull and push, with one
:class:`~kvbridge.backends.mooncake.te.MooncakeTeTransport` per rank. For a
fleet that runs Mooncake and not NIXL. What the adapter cannot do (GPU memory on
the non-CUDA wheel, lanes) is in its transport's docstring and in
docs/backends.md. Modules: :mod:`.plugin` (the registered plugin, the factory,
the worker), :mod:`.conformance` (its conformance cases).
"""

from kvbridge.connectors.mooncake_te.plugin import (
    MooncakeTePlugin,
    MooncakeTeTransportFactory,
    MooncakeTeWorker,
)

__all__ = ["MooncakeTePlugin", "MooncakeTeTransportFactory", "MooncakeTeWorker"]
