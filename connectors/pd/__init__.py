"""The prefill/decode connector core: pull and push over any one-sided transport.

No transport is named here: a transport adapter (a package beside this one,
under its connector's name) gives the worker a
:class:`~kvbridge.connectors.pd.transport.TransportFactory` and registers a
plugin under its own name; everything else is this package.

Modules, pure ones first: :mod:`.settings` (extra config), :mod:`.messages`
(notification records), :mod:`.routing` (index math), :mod:`.leases` (lease
bookkeeping), :mod:`.state` (a consumer's receive state machine),
:mod:`.send_state` (a producer's push state machine), :mod:`.verify` (digest
planning and checks), :mod:`.transport` (what the core needs of a transport,
a protocol), :mod:`.observe` (the worker's observer protocol, for tracing),
:mod:`.session` (handshaken peers); then :mod:`.scheduler` and :mod:`.worker`
(the two halves; the worker is a facade over its parts: :mod:`.worker_state`
(their shared context), :mod:`.sessions`, :mod:`.loads`, :mod:`.load_checks`,
:mod:`.push_consumer`, :mod:`.holds`, :mod:`.hold_digests`, :mod:`.push`,
:mod:`.pump`).

May not import: any transport library or adapter (``tests/connectors/pd/
test_transport_neutral.py`` reads the package for their names).
"""
