"""The front door of a kvbridge-enabled vLLM: a request's ``kv_transfer_params`` checked
in the API server, before vLLM hands the request to its engine.

Anyone who can send a completion request to a decode engine chooses its
``kv_transfer_params``. vLLM passes them on as an opaque ``dict`` (in
``SamplingParams.extra_args``): into the engine core, across its process
boundary, to the scheduler's connector. The engine refuses what it can (the
consumer's connector recomputes a request whose kvbridge params do not fit
it), but two things must never get that far:

* **nesting**: vLLM 0.32 dies (``RecursionError``) serialising a request whose
  ``kv_transfer_params`` nest a few hundred levels deep, with or without a KV
  connector (docs/vllm.md, "The front door"); a record kvbridge writes nests 3
  levels (``kvbridge.block_ids[r][i]``);
* **a malformed or oversized kvbridge record**: it would be parsed again on
  every scheduler hook call (a million ids: ~150 ms each) before being ignored.

:func:`check_kv_transfer_params` refuses both with an error naming the field. It
is pure (no vLLM import): :mod:`kvbridge.integrations.vllm.params_gate` calls it
from vLLM's per-request admission hook (a logits processor's ``validate_params``,
which vLLM runs in the API-server process and answers with HTTP 400).

What it cannot check there (vLLM's hook sees the sampling params, not the
prompt or the engine's block size) the consumer's connector checks in the
engine: the ids against the prompt's length (``TransferParams.check_request``),
the seal and the prompt chain.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbridge.connectors import TransferParams, TransferParamsError
from kvbridge.layouts.limits import MAX_BLOCK_ID

#: What vLLM's ``--logits-processors`` takes to run this check at admission (V1 model
#: runner; ``...:KVBridgeParamsGateV2`` under the V2 runner).
GATE = "kvbridge.integrations.vllm.params_gate:KVBridgeParamsGate"
#: Key of kvbridge's record inside ``kv_transfer_params`` (as ``request_view.PARAMS_KEY``).
PARAMS_KEY = "kvbridge"
#: Containers nested inside ``kv_transfer_params`` (a dict is level 1). kvbridge's own
#: record reaches 3, vLLM's connectors' params 2-3; vLLM's request serialisation
#: dies past a few hundred. Checked without recursion, so the check cannot die of it.
MAX_PARAMS_DEPTH = 16
#: Entries of the kvbridge record's ``extra`` (connector-specific scalars).
MAX_EXTRA_ENTRIES = 64
#: Characters of the kvbridge record's ``extra``, keys and string values together.
MAX_EXTRA_CHARS = 1 << 16

_FIELD = "kv_transfer_params"


class FrontDoorError(TransferParamsError):
    """A request's ``kv_transfer_params`` refused at the API server (``field`` names it).

    A ``ValueError``: vLLM's admission hook turns it into HTTP 400 with this message.
    """


def check_kv_transfer_params(raw: object) -> TransferParams | None:
    """Raise :class:`FrontDoorError` naming the field unless ``raw`` may enter the engine.

    ``raw`` is a request's ``kv_transfer_params`` (None: nothing to check).
    Returns the parsed kvbridge record when there is one. Refused: not a
    mapping; containers nested deeper than :data:`MAX_PARAMS_DEPTH`; a
    ``kvbridge`` record that does not parse (``TransferParams.from_dict``: an
    unknown version, a missing or unknown field, a wrong type, nested ``extra``,
    more than ``MAX_PARAMS_BLOCK_IDS`` ids, checked on the lists' lengths first);
    a region with more block ids than ``num_tokens + 1`` (a block holds at
    least one token); an id past ``MAX_BLOCK_ID``; an ``extra`` past
    :data:`MAX_EXTRA_ENTRIES` or :data:`MAX_EXTRA_CHARS`. The record is checked
    before anything else is walked, so a huge id list costs its lengths only.
    """
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise FrontDoorError(_FIELD, f"expected a mapping, got {type(raw).__name__}")
    params = None
    record = raw.get(PARAMS_KEY)
    if record is not None:
        params = _check_record(record)
    _check_depth({k: v for k, v in raw.items() if k != PARAMS_KEY or params is None})
    return params


def check_sampling_params(sampling_params: Any) -> TransferParams | None:
    """:func:`check_kv_transfer_params` on what vLLM keeps of a request's params
    (``SamplingParams.extra_args["kv_transfer_params"]``; vLLM's OpenAI, Anthropic
    and token-in/token-out front ends all put them there)."""
    extra_args = getattr(sampling_params, "extra_args", None)
    if not isinstance(extra_args, Mapping):
        return None
    return check_kv_transfer_params(extra_args.get(_FIELD))


def _check_record(record: object) -> TransferParams:
    field = f"{_FIELD}.{PARAMS_KEY}"
    if not isinstance(record, Mapping):
        raise FrontDoorError(field, f"expected a mapping (kvbridge's transfer params), "
                                    f"got {type(record).__name__}")
    extra = record.get("extra")
    if isinstance(extra, Mapping):
        if len(extra) > MAX_EXTRA_ENTRIES:
            raise FrontDoorError(f"{field}.extra", f"{len(extra)} entries; at most "
                                                   f"{MAX_EXTRA_ENTRIES}")
        chars = sum(len(k) if isinstance(k, str) else 0 for k in extra) + sum(
            len(v) if isinstance(v, str) else 0 for v in extra.values())
        if chars > MAX_EXTRA_CHARS:
            raise FrontDoorError(f"{field}.extra", f"{chars} characters of keys and strings; "
                                                   f"at most {MAX_EXTRA_CHARS}")
    try:
        params = TransferParams.from_dict(record)
    except TransferParamsError as exc:
        raise FrontDoorError(field + exc.field.removeprefix("transfer_params"),
                             exc.reason) from None
    most = params.num_tokens + 1
    for r, ids in enumerate(params.block_ids):
        if len(ids) > most:
            raise FrontDoorError(f"{field}.block_ids[{r}]",
                                 f"{len(ids)} block ids for num_tokens={params.num_tokens}; "
                                 f"a block holds at least one token, so at most {most}")
        if ids and max(ids) > MAX_BLOCK_ID:
            position = next(k for k, b in enumerate(ids) if b > MAX_BLOCK_ID)
            raise FrontDoorError(f"{field}.block_ids[{r}][{position}]",
                                 f"past the largest block id any cache holds ({MAX_BLOCK_ID})")
    return params


def _check_depth(root: Mapping[Any, Any]) -> None:
    """Refuse containers nested past :data:`MAX_PARAMS_DEPTH`, walking with a stack
    (never recursion: the input that kills vLLM's serialiser must not kill this)."""
    stack: list[tuple[object, int, str]] = [(root, 1, _FIELD)]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_PARAMS_DEPTH:
            raise FrontDoorError(path, f"nested deeper than {MAX_PARAMS_DEPTH} levels; "
                                       f"transfer params are flat records")
        if isinstance(value, Mapping):
            for key, item in value.items():
                if isinstance(item, Mapping | list | tuple):
                    stack.append((item, depth + 1, f"{path}.{_short(key)}"
                                  if depth < 4 else path))
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                if isinstance(item, Mapping | list | tuple):
                    stack.append((item, depth + 1, f"{path}[{index}]" if depth < 4 else path))


def _short(key: object) -> str:
    text = str(key)
    return text if len(text) <= 40 else text[:37] + "..."
