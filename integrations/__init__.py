"""kvbridge.integrations: adapters into real serving engines (vLLM first)."""
