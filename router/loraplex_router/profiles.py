"""The routing profile a router uses: the one its routing table names (the AdapterPool's
`spec.routing`), else the one its flags name (`--profile`, `--routing-option`, `--scorers`, `--picker`).

The table is followed live: a new version that names another choice switches the profile for the
requests that pick a server from then on (those in flight keep their server). A choice that cannot
be built here (a profile this router does not know, a latency profile missing from its image) is
logged once and the profile in use is kept: whatever the table says, requests keep being routed.
"""

from __future__ import annotations

import logging

from loraplex.routing.choice import RoutingChoice, build_profile
from loraplex.routing.pipeline import Profile
from loraplex.routing.table import RoutingTable
from loraplex_router.metrics import RouterMetrics
from loraplex_router.proxy import Proxy

log = logging.getLogger("loraplex.router")


class ProfileSwitch:
    """Follows the routing table's choice (`follow`, in the table cache's thread) and hands the profile
    to the proxy, which reads it on the event loop for every pick."""

    def __init__(self, flags: Profile, flags_name: str, metrics: RouterMetrics) -> None:
        """`flags`: the profile the router's flags built, named `flags_name`. Profiles built from the
        table share its random source (seeded in tests)."""
        self.flags, self.flags_name, self.metrics = flags, flags_name, metrics
        self.profile = flags
        self.choice: RoutingChoice | None = None   # the table's choice in use; None: the flags'
        self.refused: RoutingChoice | None = None  # the choice in the table that could not be built
        self.proxy: Proxy | None = None
        self._export()

    def attach(self, proxy: Proxy) -> None:
        """The proxy picks with the profile in use from now on."""
        self.proxy = proxy
        proxy.profile = self.profile

    def follow(self, table: RoutingTable | None) -> None:
        """Uses the table's choice, or the flags' profile when the table names none."""
        choice = table.routing if table is not None else None
        if choice == self.choice or (choice is not None and choice == self.refused):
            return
        if choice is None:
            self._use(self.flags, None)
            return
        try:
            profile = build_profile(choice, self.flags.rng)
        except Exception as exc:  # a bad choice must never stop the router: keep the profile in use
            self.refused = choice
            log.error("the routing table names profile %s, which this router cannot build (%s); still "
                      "routing with %s", choice.describe(), exc, self._name())
            return
        self._use(profile, choice)

    def _use(self, profile: Profile, choice: RoutingChoice | None) -> None:
        self.profile, self.choice, self.refused = profile, choice, None
        if self.proxy is not None:
            self.proxy.profile = profile  # one reference swap: a pick sees the old profile or the new one
        log.info("routing with profile %s (%s)", self._name(), "the routing table's" if choice else "the flags'")
        self._export()

    def _name(self) -> str:
        return self.choice.describe() if self.choice else self.flags_name

    def _export(self) -> None:
        source = "table" if self.choice else "flags"
        self.metrics.routing_profile.info({"profile": self.choice.profile if self.choice else self.flags_name,
                                           "source": source})
