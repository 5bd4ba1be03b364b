"""A client API key as the router sees it: the control plane's key, without its secret.

Part of the fleet's configuration (routing.fleet.snapshot carries the live ones); what the
router does with them is routing.admission.auth's.
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.fleet.priority import STANDARD


@dataclass(frozen=True, slots=True)
class ClientKey:
    """One live key as the router sees it: no secret, only the digest."""

    id: int
    name: str
    prefix: str
    digest: bytes
    models: frozenset[str] = frozenset()  # models or aliases; empty: every model
    rpm: int | None = None
    tpm: int | None = None
    explain: bool = False  # may ask for X-Route-Explain (routing.telemetry.explain)
    priority: str = STANDARD  # its requests' highest class (routing.fleet.priority)
    weight: float = 1.0  # its share against its class's other keys (routing.admission.admission)
    daily_tokens: int | None = None  # token budgets (routing.admission.budgets); None: none
    monthly_tokens: int | None = None

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models
