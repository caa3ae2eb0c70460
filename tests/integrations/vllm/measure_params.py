"""Measure what kvbridge's transfer params cost a P/D deployment in real vLLM (CPU).

Not a test (pytest does not collect it): run in the vLLM venv,

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m tests.integrations.vllm.measure_params [--json]

It starts a producer and a consumer (``KVBridgeNixlConnector`` pull, a cluster
secret, the consumer with kvbridge's admission gate and
``kv_load_failure_policy: recompute``), and reports:

* the bytes of the producer's ``kv_transfer_params`` JSON for a 1,000-token
  prompt (block size 32: 32 block ids), and of its ``kvbridge`` record alone;
* the consumer's refusal counters on ``/metrics`` (the lines as vLLM prints
  them) after one request of each kind it refuses in the engine: ``num_tokens``
  past the prompt, more ids than the prompt needs, another prompt's params, a
  changed seal, params replayed after their use.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import urllib.request
from pathlib import Path

from kvbridge.auth import new_secret
from kvbridge.integrations.vllm import configs
from kvbridge.integrations.vllm import harness as h
from kvbridge.integrations.vllm.front_door import GATE
from kvbridge.integrations.vllm.tiny_model import ensure_tiny_llama

PROMPT_TOKENS = 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvb-measure-"))
    secret = work / "cluster.secret"
    new_secret(secret)
    model = str(ensure_tiny_llama(work / "model"))
    producer_config = configs.kvbridge_nixl_config("kv_producer",
                                                 extra={"auth_secret_file": str(secret)})
    consumer_config = {**configs.kvbridge_nixl_config("kv_consumer",
                                                    extra={"auth_secret_file": str(secret)}),
                       "kv_load_failure_policy": "recompute"}
    specs = configs.pair_specs(model, "measure", producer_config, consumer_config)
    producer_spec, consumer_spec = (
        h.ServerSpec(s.name, s.model, s.port, max_model_len=2048, core=s.core,
                     kv_transfer_config=s.kv_transfer_config, extra_args=extra)
        for s, extra in ((specs[0], ()), (specs[1], ("--logits-processors", GATE))))
    with h.server_group(work / "logs") as group:
        producer, consumer = group.start(producer_spec, consumer_spec, timeout_s=600)
        long_prompt = h.make_prompts(1, PROMPT_TOKENS, seed=1000)[0]
        params = producer.complete(long_prompt, 1, h.producer_params()).kv_transfer_params
        assert params and "kvbridge" in params
        sizes = {"prompt_tokens": PROMPT_TOKENS,
                 "kv_transfer_params_bytes": len(json.dumps(params, separators=(",", ":"))),
                 "kvbridge_record_bytes": len(json.dumps(params["kvbridge"],
                                                         separators=(",", ":"))),
                 "record_fields": sorted(params["kvbridge"])}
        prompt_a, prompt_b = h.make_prompts(2, 96, seed=77)
        for kind in ("num_tokens", "block_ids", "prompt", "seal", "replay"):
            sent = prompt_b if kind == "prompt" else prompt_a
            record = copy.deepcopy(producer.complete(sent, 1, h.producer_params())
                                   .kv_transfer_params)
            assert record is not None
            kvb = record["kvbridge"]
            if kind == "num_tokens":
                kvb["num_tokens"] = 10**9
            elif kind == "block_ids":
                kvb["block_ids"] = [g * 5 for g in kvb["block_ids"]]
            elif kind == "seal" and kvb.get("seal"):
                kvb["seal"] = kvb["seal"][:-1] + ("0" if kvb["seal"][-1] != "0" else "1")
            elif kind == "replay":  # loaded once, then sent again
                consumer.complete(prompt_a, 4, record)
                consumer.reset_prefix_cache()
            consumer.complete(prompt_a, 4, record)
            consumer.reset_prefix_cache()
        before: dict[str, float] = {}
        consumer.metrics_once_grown(before, h.REFUSED_PARAMS)
        with urllib.request.urlopen(consumer.base_url + "/metrics", timeout=10) as resp:
            lines = [line for line in resp.read().decode().splitlines()
                     if line.startswith("vllm:kvbridge_refused_params")]
    if args.json:
        print(json.dumps({**sizes, "metrics": lines}, indent=2))  # noqa: T201
    else:
        print(json.dumps(sizes))  # noqa: T201
        print("\n".join(lines))  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
