"""The verified-KV settings every connector takes (``verify``, ``verify_sample``,
``verify_allow_unverified``), parsed once with errors that name the key."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge.connectors.errors import ConfigError
from kvbridge.layouts.digests import DEFAULT_MODE, DEFAULT_SAMPLE, DigestMode, VerifyPolicy

VERIFY_KEYS = ("verify", "verify_sample", "verify_allow_unverified")


@dataclass(frozen=True, kw_only=True)
class VerifySettings:
    """The verify keys as fields of a connector's settings (base of their dataclasses)."""

    verify: DigestMode = DEFAULT_MODE
    verify_sample: float = DEFAULT_SAMPLE
    verify_allow_unverified: bool = True

    @property
    def verify_policy(self) -> VerifyPolicy:
        """The reader's verification policy these settings describe."""
        return VerifyPolicy(self.verify, self.verify_sample, self.verify_allow_unverified)


def parse_verify(extra: Mapping[str, Any], where: str = "kv_connector_extra_config",
                 default: DigestMode = DEFAULT_MODE) -> VerifyPolicy:
    """The policy of ``extra``'s verify keys (absent: ``default``, 1/16, allowed)."""
    mode = extra.get("verify", default.value)
    try:
        parsed = DigestMode(mode)
    except ValueError:
        raise ConfigError(f"{where}.verify", f"expected one of {[m.value for m in DigestMode]}, "
                                             f"got {mode!r}") from None
    fraction = extra.get("verify_sample", DEFAULT_SAMPLE)
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) \
            or not 0 < fraction <= 1:
        raise ConfigError(f"{where}.verify_sample", f"expected the fraction of blocks checked "
                                                    f"in sample mode, in (0, 1], got "
                                                    f"{fraction!r}")
    allow = extra.get("verify_allow_unverified", True)
    if not isinstance(allow, bool):
        raise ConfigError(f"{where}.verify_allow_unverified",
                          f"expected true or false, got {allow!r}")
    return VerifyPolicy(parsed, float(fraction), allow)
