"""kvbridge: move paged KV cache between LLM serving engines.

Producer (prefill) to consumer (decode) over NIXL, into and out of the Mooncake
distributed store, and down into a tiered offload store. See README.md and
docs/README.md. Only public names are exported here; import submodules for the rest.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
