"""Fixtures shared by the KV events tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvbridge.events import KVEventSubscriber, SubscriberConfig


@pytest.fixture
def make_subscriber() -> Iterator[Callable[..., KVEventSubscriber]]:
    made: list[KVEventSubscriber] = []

    def make(**kwargs: Any) -> KVEventSubscriber:
        sub = KVEventSubscriber(SubscriberConfig(**kwargs))
        made.append(sub)
        return sub

    yield make
    for sub in made:
        sub.close()
